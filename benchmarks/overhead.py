"""Pipeline overhead on a fast link: ClappingStrategy against torch.distributed.pipelining, and against itself
without Lightning.

    python benchmarks/overhead.py [--quick | --tiny] [--out benchmarks/results]

Same model, data, micro-batches, optimizer and GPipe schedule for all three, uncompressed (identity wire), all
ranks on this machine's loopback. One set of worker processes runs the three methods in alternating rounds, so
each ratio compares measurements taken side by side:

* ``torch_pipelining``: torch.distributed.pipelining's ``ScheduleGPipe`` with hand-built stage modules;
* ``bare_executor``: this package's executor and stage runner driven by a plain loop (no Lightning);
* ``lightning``: ``Trainer(strategy=ClappingStrategy(...))`` (timed between steps, set-up excluded).

Throughput is samples per second over the timed steps; the headline is lightning / torch_pipelining (target >= 0.95)
and lightning / bare_executor (the cost of the Lightning integration).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _machine import describe  # noqa: E402
from _table import table  # noqa: E402

SIZES = {  # name: (layers = stages, d, heads, block, batch, microbatches, vocab, timed steps, warm-up, rounds)
    "tiny": (2, 16, 2, 8, 4, 2, 16, 2, 1, 1),
    "quick": (4, 128, 4, 128, 32, 8, 84, 10, 2, 3),
    "full": (4, 128, 4, 128, 32, 8, 84, 25, 3, 5),
}


def make_model(cfg):
    from char_lm import CharTransformer

    layers, d, heads, block, *_ = cfg
    torch.manual_seed(0)
    return CharTransformer(cfg[6], block_size=block, d=d, heads=heads, layers=layers)


def batches(cfg, n):
    _, _, _, block, batch, _, vocab, *_ = cfg
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (n, batch, block + 1), generator=g)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in data]


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class _First(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.tok, self.pos, self.block = m.tok, m.pos, m.blocks[0]

    def forward(self, idx):
        return self.block(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))


class _Last(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.block, self.norm, self.head = m.blocks[-1], m.norm, m.head

    def forward(self, x):
        return self.head(self.norm(self.block(x)))


def run_torch_pipelining(rank, world, cfg, data):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    model = make_model(cfg)
    part = _First(model) if rank == 0 else _Last(model) if rank == world - 1 else model.blocks[rank]
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=cfg[5], loss_fn=lm_loss)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-3)

    def step(batch):
        opt.zero_grad()
        if rank == 0:
            schedule.step(batch[0])
        elif rank == world - 1:
            schedule.step(target=batch[1])
        else:
            schedule.step()
        opt.step()

    return _timed(step, data, cfg)


def run_bare_executor(rank, world, cfg, data):
    from lightning_clapping.pipeline.executor import PipelineExecutor
    from lightning_clapping.codecs.feedback import MessageRule, StepContext
    from lightning_clapping.comm.placement import Placement, Topology
    from lightning_clapping.pipeline.microbatch import split_batch
    from lightning_clapping.pipeline.partition import build_partition
    from lightning_clapping.pipeline.stage import StageRunner

    model = make_model(cfg)
    splits = [f"blocks.{i}" for i in range(1, world)]
    stage = world - 1 - rank  # as the strategy maps them: the last stage on rank 0
    runner = StageRunner(model, build_partition(model, world, splits), stage)
    runner.release_foreign_state()
    runner.install()
    executor = PipelineExecutor(runner, Placement(Topology(world, 1, world), rank, torch.device("cpu")),
                                lambda b, d, t: MessageRule("uncompressed", "identity", b, d), schedule="gpipe")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.device.type != "meta"], lr=1e-3)

    def step(batch):
        opt.zero_grad()
        micro, sizes = split_batch(batch, cfg[5])
        weights = [n / sum(sizes) for n in sizes]
        executor.train_step(micro, lambda mb, j: lm_loss(model(mb[0]), mb[1]), weights, StepContext(sizes=sizes))
        opt.step()

    return _timed(step, data, cfg)


def run_lightning(rank, world, cfg, data):
    import lightning as L

    import lightning_clapping

    warmup, timed = cfg[8], cfg[7]

    class Clock(L.Callback):
        def __init__(self):
            self.start = self.end = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.end = time.perf_counter()

    model = make_model(cfg)
    clock = Clock()
    strategy = lightning_clapping.ClappingStrategy(split_points=[f"blocks.{i}" for i in range(1, world)],
                                                   microbatches=cfg[5], schedule="gpipe", log_bytes=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=world, strategy=strategy,
                        max_steps=warmup + timed, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[clock])
    model.configure_optimizers = lambda: torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    return timed * cfg[4] / (clock.end - clock.start)


def _timed(step, data, cfg):
    warmup, timed = cfg[8], cfg[7]
    for batch in data[:warmup]:
        step(batch)
    dist.barrier()
    start = time.perf_counter()
    for batch in data[warmup:warmup + timed]:
        step(batch)
    dist.barrier()
    return timed * cfg[4] / (time.perf_counter() - start)


METHODS = {"torch_pipelining": run_torch_pipelining, "bare_executor": run_bare_executor, "lightning": run_lightning}


def worker(rank, world, port, cfg, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK=str(rank),
                      LOCAL_RANK="0", RANK=str(rank), OMP_NUM_THREADS="1")  # Lightning would raise it otherwise
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = batches(cfg, cfg[7] + cfg[8])
    results = {name: [] for name in METHODS}
    for _ in range(cfg[9]):
        for name, fn in METHODS.items():
            dist.barrier()
            results[name].append(fn(rank, world, cfg, data))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    cfg = SIZES[mode]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = out / "overhead_raw.json"
    mp.spawn(worker, args=(cfg[0], port, cfg, str(raw)), nprocs=cfg[0])
    results = json.loads(raw.read_text())
    raw.unlink()
    med = {k: statistics.median(v) for k, v in results.items()}
    summary = {
        "mode": mode,
        "machine": describe(threads_per_rank=1),
        "setup": dict(zip(["stages", "d", "heads", "block", "batch", "microbatches", "vocab", "timed_steps",
                           "warmup_steps", "rounds"], cfg)) | {"schedule": "gpipe", "link": "loopback (gloo)"},
        "samples_per_s": results,
        "median_samples_per_s": med,
        "lightning_vs_torch_pipelining": med["lightning"] / med["torch_pipelining"],
        "bare_executor_vs_torch_pipelining": med["bare_executor"] / med["torch_pipelining"],
        "lightning_vs_bare_executor": med["lightning"] / med["bare_executor"],
    }
    (out / "overhead.json").write_text(json.dumps(summary, indent=2))
    with open(out / "overhead.csv", "w") as f:
        f.write("method,round,samples_per_s\n")
        for name, values in results.items():
            for i, v in enumerate(values):
                f.write(f"{name},{i},{v:.3f}\n")
    print(f"machine: {summary['machine']}\nsetup: {summary['setup']}")
    print()
    print(table([(name, med[name], ", ".join(f"{v:.1f}" for v in values)) for name, values in results.items()],
                ["method", "median samples/s", "rounds"], floatfmt=(None, ".1f"), colalign=("left", "right", "left")))
    print(f"\nlightning / torch_pipelining     = {summary['lightning_vs_torch_pipelining']:.3f}  (target >= 0.95: "
          f"{'met' if summary['lightning_vs_torch_pipelining'] >= 0.95 else 'not met'})")
    print(f"bare_executor / torch_pipelining = {summary['bare_executor_vs_torch_pipelining']:.3f}")
    print(f"lightning / bare_executor        = {summary['lightning_vs_bare_executor']:.3f}  (cost of the Lightning "
          "integration)")
    return summary


if __name__ == "__main__":
    main()
