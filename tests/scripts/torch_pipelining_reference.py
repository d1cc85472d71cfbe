"""The same one-step gradient computation with torch.distributed.pipelining (an independent implementation).

python torch_pipelining_reference.py DEVICES OUT [--microbatches 4]

The model and its batch are built here and each rank is handed its part; the ranks are forked from this process, so
they import nothing again.
"""

import argparse
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.nn import functional as F


def run(rank, world, port, out, microbatches, parts, batch):
    """``parts[rank]``: (index of its first layer in the model's ``net``, the layers)."""
    torch.set_num_threads(1)  # a forked process has none of its parent's OpenMP threads
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lo, part = parts[rank]
    x, y = batch
    stage = PipelineStage(part, stage_index=rank, num_stages=world, device=torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=F.cross_entropy)
    if rank == 0:
        schedule.step(x.flatten(1))
    elif rank == world - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    grads = {f"net.{lo + int(n.split('.')[0])}.{n.split('.', 1)[1]}": p.grad.clone()
             for n, p in part.named_parameters()}
    torch.save(grads, Path(out) / f"reference_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main():
    from torch import nn

    from _models import SPLITS, build

    ap = argparse.ArgumentParser()
    ap.add_argument("devices", type=int)
    ap.add_argument("out")
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    model, batch = build("mlp")
    cuts = [0] + [int(name.split(".")[1]) for name in SPLITS["mlp"][args.devices]] + [len(model.net)]
    parts = [(lo, nn.Sequential(*model.net[lo:hi])) for lo, hi in zip(cuts, cuts[1:])]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run, args=(args.devices, port, args.out, args.microbatches, parts, batch), nprocs=args.devices,
                       start_method="fork")


if __name__ == "__main__":
    main()
