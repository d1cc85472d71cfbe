"""One rank of a slow_network run, started by the launcher inside the rank's namespace as
``python benchmarks/slow_network.py --worker CONFIG`` with the environment torchrun would give it (``NODE_RANK``,
``GLOO_SOCKET_IFNAME``, ...). It trains the char-LM pipeline with the run's variant, records every training step and
validation (wall time, the interface's byte counters, the strategy's logged numbers) and writes ``rank<R>.json``
into the run's folder.

Only the ranks import this module (it imports torch and Lightning); the launcher never does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import lightning as L
from lightning.pytorch.callbacks import Callback

from _slow_network_settings import ROOT, codec_arg

sys.path.insert(0, str(ROOT / "examples"))
from char_lm import CharTransformer  # noqa: E402
from datasets import ShakespeareDataModule  # noqa: E402

import lightning_clapping  # noqa: E402
from lightning_clapping.codecs import get_codec  # noqa: E402


def _read_counters(ifname: str) -> tuple[int, int]:
    base = Path("/sys/class/net") / ifname / "statistics"
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return 0, 0


#: the strategy's per-step byte numbers (``clapping/...``): gathered asynchronously, logged one step late
LAGGED_PREFIX = "clapping/"


def metrics_lag(steps: list[dict]) -> int:
    """1 when the ``clapping/...`` values read at step t describe step t - 1 (the strategy logs none at the first
    step and gathers its byte numbers off the critical path), 0 for a strategy that logs each step's own."""
    if not steps or any(k.startswith(LAGGED_PREFIX) for k in steps[0]):
        return 0
    return 1 if any(k.startswith(LAGGED_PREFIX) for s in steps[1:] for k in s) else 0


def align_step_metrics(steps: list[dict], lag: int) -> list[dict]:
    """Each step's row with the ``clapping/...`` values of that step: with ``lag`` 1 they are taken from the next
    row (where they were logged); the last step then has none (its numbers are only in ``byte_totals``). Timings,
    interface counters and the other metrics (``train_loss`` is the step's own) stay in their row."""
    if lag == 0:
        return [dict(s) for s in steps]
    out = []
    for i, s in enumerate(steps):
        row = {k: x for k, x in s.items() if not k.startswith(LAGGED_PREFIX)}
        if i + lag < len(steps):
            row.update((k, x) for k, x in steps[i + lag].items() if k.startswith(LAGGED_PREFIX))
        out.append(row)
    return out


def autotune_choice(choices: dict | None) -> dict[str, dict[str, str]] | None:
    """What autotune picked (the strategy's ``autotuned``: boundary -> Choice), as JSON: ``{"0": {"fwd": "q4",
    "bwd": "uncompressed"}, ...}``. A run's loss trajectory depends on it, so it is recorded with the run."""
    if not choices:
        return None
    return {str(b): {d: c.setting(d) for d in ("fwd", "bwd")} for b, c in sorted(choices.items())}




def metric_names(stages: int) -> list[str]:
    """The logged metrics a step's record keeps where they were logged: the strategy's ``clapping/...`` numbers
    (bytes of all boundaries, and of each boundary and direction) and the training loss."""
    names = ["clapping/bytes", "clapping/ratio", "clapping/fresh", "clapping/distinct_samples", "train_loss"]
    return names + [f"clapping/b{m}_{d}_bytes" for m in range(stages - 1) for d in ("fwd", "bwd")]


class Recorder(Callback):
    """Wall time and interface counters of every training step and validation (every rank keeps its own)."""

    def __init__(self, ifname: str, metric_names: list[str]) -> None:
        self.ifname, self.metric_names = ifname, metric_names
        self.steps: list[dict] = []
        self.vals: list[dict] = []
        self.train_tx = self.train_rx = self.val_tx = self.val_rx = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._c0 = _read_counters(self.ifname)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        seconds = time.perf_counter() - self._t0
        tx, rx = _read_counters(self.ifname)
        row = {"step": trainer.global_step, "seconds": seconds, "tx": tx - self._c0[0], "rx": rx - self._c0[1]}
        self.train_tx += row["tx"]
        self.train_rx += row["rx"]
        metrics = trainer.callback_metrics
        for name in self.metric_names:
            if name in metrics:
                row[name] = float(metrics[name])
        self.steps.append(row)

    def on_validation_start(self, trainer, pl_module):
        self._v0 = _read_counters(self.ifname)
        self._vt0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        tx, rx = _read_counters(self.ifname)
        self.val_tx += tx - self._v0[0]
        self.val_rx += rx - self._v0[1]
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val_loss")
        self.vals.append({"step": trainer.global_step, "val_loss": None if val is None else float(val),
                          "seconds": time.perf_counter() - self._vt0})


def make_strategy(cfg: dict) -> lightning_clapping.ClappingStrategy:
    """The run's variant as a ``ClappingStrategy``: its codecs (one per boundary where given so), schedule, and
    autotune or a fresh-step codec where the variant asks for them."""
    v, stages = cfg["variant"], cfg["stages"]
    extra = {"autotune": True} if v.get("autotune") else {}  # only then: older strategies lack the keyword
    if v.get("fresh_codec"):
        extra["fresh_codec"] = v["fresh_codec"]
    # with a Bottleneck before every cut (see worker), the k-th one sits at blocks.{cut + k}, and the cut names it
    shift = 1 if v.get("bottleneck") else 0
    return lightning_clapping.ClappingStrategy(
        split_points=[f"blocks.{i + k * shift}" for k, i in enumerate(cfg["cuts"])], microbatches=cfg["microbatches"],
        schedule=v.get("schedule") or cfg["schedule"], variant=v["variant"],
        forward_codec=codec_arg(v["forward_codec"], stages - 1, get_codec),
        backward_codec=codec_arg(v["backward_codec"], stages - 1, get_codec),
        timeout=timedelta(seconds=cfg["strategy_timeout"]), **extra)


def worker(config_path: str) -> None:
    """Train this rank's part of the run that ``config_path`` (the launcher's JSON) describes; write its records."""
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(int(cfg["threads"]))
    rank = int(os.environ["NODE_RANK"])
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    stages = cfg["stages"]

    t_start = time.perf_counter()
    L.seed_everything(cfg["seed"], verbose=False)
    dm = ShakespeareDataModule(batch_size=cfg["batch"], seed=cfg["seed"], block_size=cfg["block"],
                               limit=cfg["data_limit"])
    dm.setup("fit")
    model = CharTransformer(dm.vocab_size, block_size=cfg["block"], d=cfg["d"], heads=cfg["heads"],
                            layers=cfg["layers"])
    v = cfg["variant"]
    if v.get("bottleneck"):  # built after the model: its own weights are the plain model's for the seed
        blocks = list(model.blocks)
        for k, i in enumerate(cfg["cuts"]):
            blocks.insert(i + k, lightning_clapping.Bottleneck(cfg["d"], cfg["d"] // v["bottleneck"]))
        model.blocks = torch.nn.ModuleList(blocks)
    # lazy sampling for p < 1; AQ-SGD needs the sample ids that the wrapper reports (at p = 1 it changes nothing else)
    wrap = v["p"] < 1.0 or v["variant"] == "aqsgd" or bool(v.get("p_later"))
    p = {0: v["p"], int(v["p_later"][0]): float(v["p_later"][1])} if v.get("p_later") else v["p"]
    data = lightning_clapping.LazySamplingDataModule(dm, p=p, seed=cfg["seed"]) if wrap else dm
    strategy = make_strategy(cfg)
    recorder = Recorder(ifname, metric_names(stages))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=stages, strategy=strategy, max_steps=cfg["steps"],
        val_check_interval=cfg["val_every"], check_val_every_n_epoch=None, limit_val_batches=cfg["val_batches"],
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, callbacks=[recorder])
    assert trainer.global_rank == rank and trainer.strategy.num_stages == stages, (trainer.global_rank, stages)
    t_fit = time.perf_counter()
    trainer.fit(model, datamodule=data)
    lag = metrics_lag(recorder.steps)
    totals = getattr(trainer.strategy, "byte_totals", None)
    result = {
        "rank": rank, "stage": stages - 1 - rank, "ifname": ifname, "steps": align_step_metrics(recorder.steps, lag),
        "metrics_lag": lag, "byte_totals": dict(totals) if totals else None, "vals": recorder.vals,
        "autotune": {k: float(x) for k, x in trainer.callback_metrics.items() if k.startswith("autotune/")},
        "autotune_choice": autotune_choice(strategy.autotuned),
        "schedule": getattr(strategy, "schedule", None),
        "train_tx": recorder.train_tx, "train_rx": recorder.train_rx, "val_tx": recorder.val_tx,
        "val_rx": recorder.val_rx, "setup_seconds": t_fit - t_start, "fit_seconds": time.perf_counter() - t_fit,
        "torch_threads": torch.get_num_threads(),
        "cluster_environment": type(strategy.cluster_environment).__name__,
    }
    Path(cfg["result_dir"], f"rank{rank}.json").write_text(json.dumps(result))
    # leave together: a rank that exits while a peer still talks to it can make the peer's gloo threads abort
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
