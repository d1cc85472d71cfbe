"""One rank of an autotune run: probe this stage's links, agree on the codecs, write what it got as JSON.

    MASTER_ADDR=... MASTER_PORT=... [GLOO_SOCKET_IFNAME=...] python autotune_probe.py RANK WORLD OUT.json \
        [--nbytes N] [--compute-ms MS] [--max-repeats R]

Stages are placed as the strategy places them (stage s on rank WORLD - 1 - s). Every boundary is priced with the
message of a 4 x 128 x 128 float32 activation (and its gradient) against ``--compute-ms`` of compute per micro-batch.
tests/autotune/test_autotune.py runs it inside the delayed-link namespaces; it also runs by hand on loopback.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_clapping.autotune.choose import describe
from lightning_clapping.autotune.messages import message_bytes
from lightning_clapping.autotune.probe import probe_boundaries
from lightning_clapping.autotune.tune import agree

SHAPE = (4, 128, 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("out")
    ap.add_argument("--nbytes", type=int, default=None, help="bulk size (default: the uncompressed message)")
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--max-repeats", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60))
    n = args.world
    stage = n - 1 - args.rank

    def rank_of_stage(s: int) -> int:
        return n - 1 - s

    spec = [(SHAPE, torch.float32)]
    nbytes = args.nbytes or message_bytes(spec, "uncompressed")
    measures = probe_boundaries(stage, n, rank_of_stage, nbytes, max_repeats=args.max_repeats,
                                timeout=timedelta(seconds=60))
    shapes = {}
    if stage < n - 1:
        shapes[stage] = {"fwd": spec}
    if stage > 0:
        shapes[stage - 1] = {"bwd": spec}
    choices, every = agree(stage, n, measures, args.compute_ms / 1e3, shapes, variant="direct")
    with open(args.out, "w") as f:
        json.dump({"stage": stage, "measures": {b: m.to_wire() for b, m in measures.items()},
                   "all_measures": {b: m.to_wire() for b, m in every.items()},
                   "choices": {b: c.to_wire() for b, c in choices.items()},
                   "table": describe(choices, every)}, f)
    if args.rank == 0:
        print(describe(choices, every), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
