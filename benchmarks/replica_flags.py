"""What the replicas' gradient averaging pays for handling replicas with different sets of gradients.

    python benchmarks/replica_flags.py [--quick] [--out benchmarks/results]

Two gloo processes on loopback average the gradients of one model's parameters (the character transformer of
``examples/char_lm.py``, d=256, 8 blocks: one stage's worth) for a number of steps, three ways, alternating
step by step so the ratios compare steps taken side by side:

* ``before``: what :class:`~lightning_clapping.comm.replicas.GradientAverager` did before it took replicas with
  different sets of gradients (the gradients that exist, bucketed, one async all-reduce per bucket; written out here);
* ``flags, every gradient``: the averager now (every trainable parameter, plus one presence flag per parameter at the
  end of the last bucket), every replica with every gradient: the usual case;
* ``flags, a block missing``: the same, with rank 1 lacking the gradients of two of the 8 blocks (an expert that
  none of its tokens reached): zeros are sent for them and the flags are read on the host.

Reports the bytes each rank hands to the all-reduce per step and the median time per step (start to finish, the
average written back). Saves ``replica_flags.json``.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

WAYS = ("before", "flags, every gradient", "flags, a block missing")
MODES = {"full": (60, 5), "quick": (12, 2)}  # timed steps per way, warm-up steps


def _before(params, group, replicas, bucket_bytes):
    """The averaging as it was: only the parameters that hold a gradient."""
    import torch
    import torch.distributed as dist

    from lightning_clapping.comm.replicas import _buckets

    grads = [p.grad for p in params if p.grad is not None]
    pending = []
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        flat.div_(replicas)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return sum(g.numel() * g.element_size() for g in grads)


def worker(rank: int, port: int, steps: int, warmup: int, bucket_bytes: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from char_lm import CharTransformer
    from lightning_clapping.comm.replicas import GradientAverager

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = CharTransformer(65, d=256, layers=8)
    params = [p for p in model.parameters() if p.requires_grad]
    missing = {id(p) for b in model.blocks[2:4] for p in b.parameters()}
    averager = GradientAverager(None, replicas=2, bucket_bytes=bucket_bytes)
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    sent: dict[str, int] = {}
    for step in range(warmup + steps):
        for way in WAYS:
            for p in params:
                lacks = way == "flags, a block missing" and rank == 1 and id(p) in missing
                p.grad = None if lacks else torch.randn_like(p)
            dist.barrier()
            t0 = time.perf_counter()
            if way == "before":
                nbytes = _before(params, None, 2, bucket_bytes)
            else:
                averager.start(params)
                averager.finish()
                nbytes = sum(p.numel() * p.element_size() for p in params) + len(params) * 4  # fp32 flags
            elapsed = time.perf_counter() - t0
            if step >= warmup:
                times[way].append(elapsed)
            sent[way] = nbytes
    if rank == 1:
        result = {"steps": steps, "warmup": warmup, "bucket_bytes": bucket_bytes, "parameters": len(params),
                  "ways": {w: {"bytes_per_step_rank1": sent[w], "median_ms": 1e3 * statistics.median(times[w]),
                               "ms": [round(1e3 * t, 3) for t in times[w]]} for w in WAYS}}
        (out / "replica_flags_rank1.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    steps, warmup = MODES["quick" if args.quick else "full"]
    args.out.mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    from _machine import describe
    from _table import table
    from lightning_clapping.comm.replicas import BUCKET_BYTES

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, steps, warmup, BUCKET_BYTES, args.out), nprocs=2, start_method="fork")
    result = json.loads((args.out / "replica_flags_rank1.json").read_text())
    (args.out / "replica_flags_rank1.json").unlink()
    base = result["ways"]["before"]
    for way in WAYS:
        r = result["ways"][way]
        r["bytes_vs_before"] = r["bytes_per_step_rank1"] / base["bytes_per_step_rank1"]
        r["time_vs_before"] = r["median_ms"] / base["median_ms"]
    result["machine"] = describe()
    name = "replica_flags_quick.json" if args.quick else "replica_flags.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    print(f"{result['parameters']} parameters, buckets of {result['bucket_bytes'] >> 20} MiB, 2 gloo ranks, "
          f"{steps} steps")
    ways = result["ways"]
    print(table([(w, ways[w]["bytes_per_step_rank1"], ways[w]["bytes_vs_before"], ways[w]["median_ms"],
                  ways[w]["time_vs_before"]) for w in WAYS],
                ["way", "bytes/step (rank 1)", "vs before", "median ms", "vs before"],
                floatfmt=(None, ",", ".5f", ".2f", ".3f")))
    print(f"saved {args.out / name}")


if __name__ == "__main__":
    main()
