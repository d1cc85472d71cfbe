"""What one CUDA GPU can check of the GPU path (NCCL needs two GPUs for a pipeline; this needs one), in minutes.

    python tests/gpu/one_gpu_check.py [--device cuda] [--out benchmarks/results] [--quick]

Four parts, each timed and checked; the figures and every check's verdict go to ``OUT/gpu_check.json`` (a dry run
with ``--device cpu`` writes ``gpu_check_dryrun_cpu.json``, so it never overwrites a GPU's figures):

1. ``codecs``: every codec's encode and decode on device tensors shaped like pipeline messages, against a device
   memory copy of the same tensor (CUDA events, medians). Checks: payloads are 1-D ``uint8`` on the device and as
   long as ``payload_nbytes`` says; a deterministic codec's payload decodes on the CPU to what it decodes to here.
2. ``feedback``: the message rule of every variant, both ends in this process, applied to real activations (the
   output of the first half of a small transformer) and their gradients, while the model trains, with lazy
   sampling (a batch reused with probability 1/2). Messages go through the wire format on the device. Checks: the
   receiver predicts every message's form; both ends' state is bit-identical at the end; messages and decoded
   values stay on the device; AQ-SGD's per-sample rows live on the CPU.
3. ``fit``: a 1-stage ``ClappingStrategy`` fit on the GPU with ``bf16-mixed`` (NCCL process group of one rank,
   byte statistics on, 4 micro-batches), against a plain Lightning fit of the same model. Checks: finite losses that
   fall, the first loss within 1 % of the plain run's and the last ones within 10 %, a NCCL process group.
4. ``materialize``: a model built on the meta device, materialized onto the GPU whole and stage by stage (2 stages).
   Checks: every tensor on the device and finite; the stages' tensors equal the whole model's, bit for bit; twice
   the same weights.

Exit status: 0 when every check passed, 1 when one failed (the JSON says which), 3 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

CODECS = ["identity", "bf16", "fp16", "fp8", "q8", "q4", "q2", "q4:group128", "q4:sr", "q4:fp16", "topk:0.1",
          "topk:0.1+q8", "randk:0.1", "randk:0.1+q4"]
STOCHASTIC = ("sr", "randk")  # their decode draws from the device's generator: the CPU would draw otherwise


class Report:
    """The checks and figures of a run, written as JSON."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.checks: list[dict[str, Any]] = []
        self.parts: dict[str, Any] = {}

    def check(self, name: str, ok: bool, **detail: Any) -> bool:
        self.checks.append({"check": name, "ok": bool(ok), **detail})
        print(f"  [{'ok' if ok else 'FAILED'}] {name}" + (f": {detail}" if detail and not ok else ""), flush=True)
        return bool(ok)

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            self.parts[name] = fn()
        except Exception as err:  # one part failing must not hide the others' figures
            self.parts[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            self.check(f"{name} ran", False, error=f"{type(err).__name__}: {err}")
            traceback.print_exc()
        self.parts.setdefault(name, {})
        if isinstance(self.parts[name], dict):
            self.parts[name]["seconds"] = round(time.perf_counter() - start, 2)

    def write(self, path: Path) -> None:
        from _machine import describe

        machine = describe(device=str(self.device))
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            machine.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                           cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
        path.parent.mkdir(parents=True, exist_ok=True)
        failed = [c["check"] for c in self.checks if not c["ok"]]
        path.write_text(json.dumps({"machine": machine, "passed": not failed, "failed": failed,
                                    "checks": self.checks, **self.parts}, indent=1, default=str))
        print(f"wrote {path}: {len(self.checks) - len(failed)}/{len(self.checks)} checks passed", flush=True)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU: the device's time, whatever the CPU waits for)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------------ 1. codecs
def codecs_part(report: Report, quick: bool) -> dict[str, Any]:
    from lightning_clapping.codecs import get_codec

    device = report.device
    shapes = [(1024, 256)] if quick else [(8192, 1024), (32768, 1024)]  # 8 M and 32 M values: 32 and 128 MB fp32
    repeats = 3 if quick else 10
    rows = []
    for shape in shapes:
        x = torch.randn(shape, device=device, generator=None)
        y = torch.empty_like(x)
        copy_s = timed(lambda: y.copy_(x), device, repeats)
        rows.append({"shape": list(shape), "codec": "memcpy", "encode_s": copy_s,
                     "copy_GBps": 2 * x.nbytes / copy_s / 1e9})  # read and written
        for name in CODECS:
            codec = get_codec(name)
            payload = codec.encode(x, seed=7)
            out = torch.empty_like(x)
            enc = timed(lambda: codec.encode(x, seed=7), device, repeats)
            dec = timed(lambda: codec.decode_into(payload, out, seed=7), device, repeats)
            decoded = codec.decode(payload, x.shape, x.dtype, seed=7)
            rel = float((decoded - x).norm() / x.norm())
            report.check(f"codec {name} {shape}: payload is 1-D uint8 on {device.type}, payload_nbytes long",
                         payload.device.type == device.type and payload.dtype == torch.uint8 and payload.dim() == 1
                         and payload.numel() == codec.payload_nbytes(x.shape, x.dtype) and decoded.device == x.device,
                         payload_device=str(payload.device), nbytes=payload.numel())
            if device.type == "cuda" and not any(s in name for s in STOCHASTIC):
                on_cpu = codec.decode(payload.cpu(), x.shape, x.dtype, seed=7)
                err = float((on_cpu - decoded.cpu()).abs().max())
                report.check(f"codec {name} {shape}: the CPU decodes the device's payload alike", err <= 1e-6 * (
                    1 + float(x.abs().max())), max_abs_difference=err)
            rows.append({"shape": list(shape), "codec": name, "encode_s": enc, "decode_s": dec,
                         "copy_over_codec": copy_s / (enc + dec), "ratio_vs_fp32": x.nbytes / payload.numel(),
                         "relative_error": rel})
            print(f"  {name:14s} {shape}: encode {enc * 1e3:8.3f} ms, decode {dec * 1e3:8.3f} ms, memcpy "
                  f"{copy_s * 1e3:7.3f} ms ({copy_s / (enc + dec):.3f} x), {x.nbytes / payload.numel():5.1f}x smaller, "
                  f"error {rel:.3g}", flush=True)
    return {"rows": rows, "note": "copy_over_codec: device memcpy time / (encode + decode) time of the same tensor"}


# ---------------------------------------------------------------------------------------------------- 2. feedback
def _split_model(device: torch.device, seed: int = 0):
    from _models import TinyGPT

    torch.manual_seed(seed)
    return TinyGPT(vocab=64, d=128, heads=4, layers=4, block=64).to(device)


def _boundary_step(model, idx, targets):
    """Forward and backward; returns the first half's output (the boundary activation) and its gradient."""
    from torch.nn import functional as F

    t = idx.shape[1]
    x = model.tok(idx) + model.pos(torch.arange(t, device=idx.device))
    mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
    for blk in model.blocks[:2]:
        x = blk(x, mask)
    x.retain_grad()
    y = x
    for blk in model.blocks[2:]:
        y = blk(y, mask)
    loss = F.cross_entropy(model.head(model.norm(y)).flatten(0, 1), targets.flatten())
    loss.backward()
    return x.detach(), x.grad.detach(), float(loss.detach())


def feedback_part(report: Report, quick: bool) -> dict[str, Any]:
    from _models import lm_data

    from lightning_clapping.codecs.feedback import VARIANTS, MessageRule, StepContext
    from lightning_clapping.comm import wire

    device = report.device
    steps, slots, rows_per_slot = (6, 2, 4) if quick else (40, 4, 8)
    data_x, data_y = lm_data(n=256, vocab=64, block=64, seed=1)
    model = _split_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    codecs = {"fwd": "q4", "bwd": "q8"}
    rules = {(v, d): tuple(MessageRule(v, codecs[d], 0, d) for _ in range(2)) for v in VARIANTS for d in codecs}
    stats = {key: {"messages": 0, "bytes": 0, "raw_bytes": 0, "rel_error_sum": 0.0, "forms": set(), "seconds": 0.0}
             for key in rules}
    agreed = {key: True for key in rules}
    on_device = {key: True for key in rules}
    g = torch.Generator().manual_seed(3)
    ids = None
    losses = []
    for step in range(steps):
        fresh = ids is None or bool(torch.rand((), generator=g) < 0.5)
        if fresh:
            ids = torch.randperm(len(data_x), generator=g)[: slots * rows_per_slot].view(slots, rows_per_slot)
        ctx = StepContext(step=step, fresh=fresh, sample_ids=list(ids))
        optimizer.zero_grad()
        acts, grads = [], []
        for j in range(slots):
            a, gr, loss = _boundary_step(model, data_x[ids[j]].to(device), data_y[ids[j]].to(device))
            acts.append(a)
            grads.append(gr)
            losses.append(loss)
        optimizer.step()
        for (variant, direction), (sender, receiver) in rules.items():
            key = (variant, direction)
            values = acts if direction == "fwd" else grads
            predicted = [receiver.mode(j, ctx) for j in range(slots)]  # the receiver posts them when the step starts
            for j in range(slots):
                t = values[j].requires_grad_(direction == "fwd")  # activations carry requires_grad, as sent
                agreed[key] &= sender.mode(j, ctx) == predicted[j]
                t0 = time.perf_counter()
                msg = wire.pack(sender.encode(j, [t], ctx), device)
                parts = wire.unpack(msg, known_codecs=wire.RULE_FORMS)
                got = receiver.decode(j, parts, ctx)[0]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                s = stats[key]
                s["seconds"] += time.perf_counter() - t0
                on_device[key] &= msg.device.type == device.type and got.device.type == device.type
                s["messages"] += 1
                s["bytes"] += msg.numel()
                s["raw_bytes"] += t.numel() * 4
                s["forms"].add(parts[0].codec)
                s["rel_error_sum"] += float((got.float() - t.detach().float()).norm() / t.detach().float().norm())
    out = {"steps": steps, "micro-batches": slots, "rows": rows_per_slot, "activation": list(acts[0].shape),
           "losses_first_last": [losses[0], losses[-1]], "codecs": codecs, "rules": []}
    names = {wire.RAW: "raw", wire.FULL: "full", wire.CODEC: "codec", wire.SKIP: "skip"}
    for key, (sender, receiver) in rules.items():
        variant, direction = key
        a, b = sender.state(), receiver.state()
        same = a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
        report.check(f"{variant} {direction}: the receiver predicted every message's form", agreed[key])
        report.check(f"{variant} {direction}: both ends' state bit-identical", same)
        report.check(f"{variant} {direction}: messages and decoded values on {device.type}", on_device[key])
        if sender.kind == "per-sample":
            rows = [r for store in sender.store.values() for r in store.values()]
            report.check(f"{variant} {direction}: per-sample rows on the CPU", rows and all(
                r.device.type == "cpu" for r in rows), rows=len(rows))
        s = stats[key]
        out["rules"].append({"variant": variant, "direction": direction, "messages": s["messages"],
                             "bytes_over_fp32": s["bytes"] / s["raw_bytes"],
                             "mean_relative_error": s["rel_error_sum"] / s["messages"],
                             "ms_per_message": 1e3 * s["seconds"] / s["messages"],
                             "forms": sorted(names[f] for f in s["forms"]),
                             "state_bytes": sender.state_bytes()})
        r = out["rules"][-1]
        print(f"  {variant:12s} {direction}: {r['bytes_over_fp32']:.3f} of fp32, error {r['mean_relative_error']:.3g}, "
              f"{r['ms_per_message']:.2f} ms/message, forms {r['forms']}", flush=True)
    report.check("the model trained while the rules ran", losses[-1] < losses[0], first=losses[0], last=losses[-1])
    return out


# ----------------------------------------------------------------------------------------------------- 3. fit
def fit_part(report: Report, quick: bool) -> dict[str, Any]:
    import lightning as L
    from _models import TinyGPT, lm_data
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_clapping import ClappingStrategy

    device = report.device
    steps = 8 if quick else 60
    x, y = lm_data(n=256, vocab=64, block=64, seed=1)

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.values.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def run(strategy: Any) -> tuple[list[float], float, Any]:
        L.seed_everything(0, verbose=False)
        model = TinyGPT(vocab=64, d=128, heads=4, layers=4, block=64)
        loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        losses = Losses()
        trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, strategy=strategy,
                            precision="bf16-mixed", max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[losses])
        start = time.perf_counter()
        trainer.fit(model, loader)
        return losses.values, time.perf_counter() - start, trainer

    pipe, pipe_s, trainer = run(ClappingStrategy(microbatches=4, liveness=None))
    totals = trainer.strategy.byte_totals
    plain, plain_s, _ = run("auto")
    tail = max(1, len(pipe) // 6)
    mean = lambda v: sum(v[-tail:]) / tail  # noqa: E731
    report.check("fit: finite losses that fall", all(map(math.isfinite, pipe)) and mean(pipe) < pipe[0],
                 first=pipe[0], last=mean(pipe))
    report.check("fit: the first step's loss (same weights, same batch) within 1 % of a plain Lightning fit's",
                 abs(pipe[0] - plain[0]) <= 0.01 * abs(plain[0]), pipeline=pipe[0], plain=plain[0])
    report.check("fit: the last losses within 10 % of a plain Lightning fit's (bf16 roundings drift apart)",
                 abs(mean(pipe) - mean(plain)) <= 0.10 * abs(mean(plain)), pipeline=mean(pipe), plain=mean(plain))
    backend = str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else None
    if device.type == "cuda":
        report.check("fit: the strategy's process group is NCCL", backend == "nccl", backend=backend)
    return {"steps": steps, "pipeline_losses": pipe, "plain_losses": plain, "pipeline_seconds": pipe_s,
            "plain_seconds": plain_s, "byte_totals": totals, "backend": backend}


# ------------------------------------------------------------------------------------------------ 4. materialize
def materialize_part(report: Report, quick: bool) -> dict[str, Any]:
    from _models import TinyGPT

    from lightning_clapping.pipeline.materialize import building_on_meta, materialize_module
    from lightning_clapping.pipeline.partition import build_partition
    from lightning_clapping.stage_setup import materialize_own_stage

    device = report.device
    size = dict(vocab=64, d=64, heads=2, layers=4, block=32) if quick else dict(vocab=512, d=512, heads=8, layers=8,
                                                                                  block=256)

    def meta_model() -> TinyGPT:
        with building_on_meta():
            return TinyGPT(**size)

    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    start = time.perf_counter()
    whole = materialize_module(meta_model(), device)
    seconds = time.perf_counter() - start
    state = {k: v for k, v in whole.state_dict().items()}
    report.check("materialize: every tensor on the device and finite", all(
        v.device.type == device.type and (not v.is_floating_point() or bool(torch.isfinite(v).all()))
        for v in state.values()), tensors=len(state))
    again = materialize_module(meta_model(), device).state_dict()
    report.check("materialize: twice the same weights", all(torch.equal(state[k], again[k]) for k in state))
    staged = meta_model()
    partition = build_partition(staged, 2, ["blocks.4" if size["layers"] == 8 else "blocks.2"])
    for stage in range(2):
        materialize_own_stage(staged, partition, stage, device)
    got = staged.state_dict()
    differ = [k for k in state if got[k].is_meta or not torch.equal(got[k], state[k])]
    report.check("materialize: the two stages' tensors equal the whole model's", not differ, differ=differ[:5])
    report.check("materialize: torch's global RNG untouched", torch.equal(torch.get_rng_state(), rng) and (
        cuda_rng is None or torch.equal(torch.cuda.get_rng_state(device), cuda_rng)))
    idx = torch.randint(0, size["vocab"], (2, size["block"]), device=device)
    with torch.no_grad():
        logits = whole(idx)
    report.check("materialize: the model runs on the device", bool(torch.isfinite(logits).all()))
    return {"parameters": sum(p.numel() for p in whole.parameters()), "seconds_whole": seconds, "model": size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of the script itself")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--quick", action="store_true", help="small sizes and few steps (a smoke run)")
    ap.add_argument("--parts", default="codecs,feedback,materialize,fit",
                    help="comma-separated subset of: codecs, feedback, materialize, fit")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device is visible (torch.cuda.is_available() is False): nothing to check here; run with "
                  "--device cpu for a dry run of the script", file=sys.stderr)
            return 3
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    report = Report(device)
    parts = {"codecs": codecs_part, "feedback": feedback_part, "materialize": materialize_part, "fit": fit_part}
    for name in args.parts.split(","):
        if name not in parts:
            ap.error(f"unknown part {name!r}: {', '.join(parts)}")
        report.run(name, lambda fn=parts[name]: fn(report, args.quick))
    name = "gpu_check.json" if device.type == "cuda" else f"gpu_check_dryrun_{device.type}.json"
    report.write(args.out / name)
    return 0 if all(c["ok"] for c in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
