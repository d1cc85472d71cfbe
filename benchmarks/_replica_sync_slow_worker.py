"""One rank of a replica_sync_slow run, started by the launcher inside the rank's namespace as
``python benchmarks/replica_sync_slow.py --worker CONFIG`` with the environment torchrun would give it (``NODE_RANK``,
``GLOO_SOCKET_IFNAME``, ``MASTER_ADDR`` ...; see ``_slow_network_launch.Runner``).

It trains the run's task of ``_quality_tasks.TASKS`` (its data, model, micro-batches and gradient clipping) cut into
2 stages at the run's split point and replicated twice (``Trainer(devices=1, num_nodes=4)``), with the run's
``replica_sync`` setting, records every training step and validation (``_slow_network_worker.Recorder``: wall time, the interface's
byte counters) and writes ``rank<R>.json`` into the run's folder. With ``stop_at`` it stops at the first validation
whose loss is at or below that value (rank 0's decision, which holds the last stage of replica 0, broadcast by the
strategy's ``reduce_boolean_decision``, as Lightning's EarlyStopping does).

Only the ranks import this module (it imports torch and Lightning); the launcher never does.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import lightning as L
from lightning.pytorch.callbacks import Callback

import lightning_clapping
from lightning_clapping.sync.config import resolve as resolve_replica_sync
from _quality_tasks import TASKS
from _slow_network_worker import Recorder
from quality import quiet

#: what each step's record keeps of the logged metrics (the clapping/... values describe the previous step)
METRICS = ["train_loss", "clapping/bytes", "clapping/replica_bytes"]


class StopAtTarget(Callback):
    """Stops the fit at the first validation with ``val_loss <= target``, on every rank at once."""

    def __init__(self, target: float) -> None:
        self.target = target
        self.stopped_at: int | None = None

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val_loss")
        hit = val is not None and float(val) <= self.target
        if trainer.strategy.reduce_boolean_decision(hit, all=False):  # rank 0's decision on every rank
            trainer.should_stop = True
            self.stopped_at = self.stopped_at or int(trainer.global_step)


def strategy_kwargs(setting: dict) -> dict:
    """A setting of the launcher (plain JSON) as ClappingStrategy arguments: ``replica_sync`` as a name or a dict
    with ``mode`` (``{"mode": "diloco", "inner_steps": 8, "codec": "topk:0.05+q4"}``), resolved here."""
    kwargs = {"forward_codec": "identity", "backward_codec": "identity", **setting}
    if "replica_sync" in kwargs:
        kwargs["replica_sync"] = resolve_replica_sync(kwargs["replica_sync"])
    return kwargs


def worker(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    quiet()
    torch.set_num_threads(int(cfg["threads"]))
    rank = int(os.environ["NODE_RANK"])
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    task = TASKS[cfg["task"]]

    t_start = time.perf_counter()
    L.seed_everything(cfg["seed"], verbose=False)
    dm = task.make_data(cfg["seed"], cfg["data_limit"], cfg["eval_samples"], task.batch_size)
    dm.setup("fit")
    model = task.make_model(dm)
    strategy = lightning_clapping.ClappingStrategy(
        split_points=cfg["split_points"], microbatches=task.microbatches,
        timeout=timedelta(seconds=cfg["strategy_timeout"]), **strategy_kwargs(cfg["setting"]))
    recorder = Recorder(ifname, METRICS)
    callbacks = [recorder]
    stopper = None
    if cfg.get("stop_at") is not None:
        stopper = StopAtTarget(float(cfg["stop_at"]))
        callbacks.append(stopper)
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=world, strategy=strategy, max_steps=cfg["steps"],
        val_check_interval=cfg["val_every"], check_val_every_n_epoch=None, limit_val_batches=cfg["val_batches"],
        num_sanity_val_steps=0, gradient_clip_val=task.gradient_clip_val, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, callbacks=callbacks)
    assert trainer.global_rank == rank, (trainer.global_rank, rank)
    t_fit = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    totals = getattr(trainer.strategy, "byte_totals", None)
    result = {
        "rank": rank, "stage": strategy.stage, "replica": strategy.replica, "num_stages": strategy.num_stages,
        "replicas": strategy.num_replicas, "ifname": ifname, "steps": recorder.steps, "vals": recorder.vals,
        "global_step": int(trainer.global_step), "stopped_at": stopper.stopped_at if stopper else None,
        "byte_totals": dict(totals) if totals else None, "replica_sync": repr(strategy_kwargs(cfg["setting"])
                                                                              .get("replica_sync", "every-step")),
        "train_tx": recorder.train_tx, "train_rx": recorder.train_rx, "val_tx": recorder.val_tx,
        "val_rx": recorder.val_rx, "setup_seconds": t_fit - t_start, "fit_seconds": time.perf_counter() - t_fit,
        "torch_threads": torch.get_num_threads(),
        "gradient_bytes": sum(p.numel() * 4 for p in model.parameters() if p.requires_grad),
    }
    Path(cfg["result_dir"], f"rank{rank}.json").write_text(json.dumps(result))
    # leave together: a rank that exits while a peer still talks to it can make the peer's gloo threads abort
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
