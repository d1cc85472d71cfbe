"""Training steps on one full batch through ClappingStrategy; each rank saves the gradients of the last step and
the weights of its stage after the last step.

python grad_check.py KIND DEVICES OUT [--schedules gpipe,1f1b] [--microbatches 4] [--auto] [--steps 1]
                     [--accelerator cpu] [--receives posted|ordered|both]

Each schedule saves <schedule>_rank<r>.pt; with --receives both, every schedule runs twice in the same processes.
--receives ordered: no receives posted ahead (prepost_receives=False): messages matched by order, as under NCCL;
                    saved as <schedule>_ordered_rank<r>.pt.
"""

import argparse
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_clapping
from lightning_clapping.pipeline.partition import count_stage_bytes
from _models import SPLITS, build


class TreeDataset(torch.utils.data.Dataset):
    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        leaves = self.batch.values() if isinstance(self.batch, dict) else self.batch
        return len(next(iter(leaves)))

    def __getitem__(self, i):
        if isinstance(self.batch, dict):
            return {k: v[i] for k, v in self.batch.items()}
        return tuple(v[i] for v in self.batch)


class SaveGrads(L.Callback):
    def __init__(self):
        self.grads, self.param_bytes = {}, None

    def on_train_start(self, trainer, pl_module):
        self.param_bytes = count_stage_bytes(pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters()
                      if p.grad is not None and p.device.type != "meta"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind")
    ap.add_argument("devices", type=int)
    ap.add_argument("out")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--auto", action="store_true")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--receives", choices=["posted", "ordered", "both"], default="posted")
    args = ap.parse_args()
    out = Path(args.out)
    orders = ["posted", "ordered"] if args.receives == "both" else [args.receives]
    for order, sched in ((o, s) for o in orders for s in args.schedules.split(",")):
        name = sched if order == "posted" else f"{sched}_ordered"
        model, batch = build(args.kind)
        cb = SaveGrads()
        split = None if args.auto else SPLITS[args.kind][args.devices]
        strategy = lightning_clapping.ClappingStrategy(split_points=split, microbatches=args.microbatches,
                                                       schedule=sched,
                                                       prepost_receives=False if order == "ordered" else None)
        trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                            max_steps=args.steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, callbacks=[cb])
        data = TreeDataset(batch)
        trainer.fit(model, DataLoader(data, batch_size=len(data)))
        weights = {n: p.detach().cpu() for n, p in model.named_parameters() if p.device.type != "meta"}
        torch.save({"grads": {n: g.cpu() for n, g in cb.grads.items()}, "weights": weights,
                    "param_bytes": cb.param_bytes, "stage": strategy.stage,
                    "stage_params": strategy.partition.stage_params},
                   out / f"{name}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
