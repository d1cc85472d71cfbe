"""One node's part of a two-node run, started once per node the way users start multi-node Lightning jobs.

python multinode_run.py OUT CASE        CASE: pipeline | dp

pipeline: 4 stages over 2 nodes x 2 devices, batches of 8 in the DataLoader's own order.
dp:       2 pipeline replicas x 2 stages (``stages=2``), batches of 4 per replica; Lightning's default
          ``use_distributed_sampler=True`` splits the data between the replicas.

Launched either with Lightning's own multi-node variables (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``,
``WORLD_SIZE``: Lightning starts the node's second process) or by ``torchrun`` (one process per device). Both cases
run 3 SGD steps on 24 samples. Every rank writes ``OUT/rank<global rank>.pt``: where it ran, the inputs of every
batch it trained on, and the parameters it holds after ``fit``.
"""

import gc
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data

SAMPLES, STEPS, SEED, DATA_SEED = 24, 3, 0, 1


class Inputs(L.Callback):
    """The inputs of every training batch this rank received."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[0].detach().clone())


def main(out: Path, case: str) -> None:
    torch.manual_seed(SEED)
    model = SequentialMLP(lr=0.1, optimizer="sgd")  # net.0 .. net.6: Linear, Tanh, Linear, Tanh, Linear, Tanh, Linear
    x, y = classification_data(n=SAMPLES, seed=DATA_SEED)
    if case == "pipeline":
        strategy = lightning_clapping.ClappingStrategy(split_points=["net.2", "net.4", "net.6"], microbatches=2)
        batch_size = 8
    elif case == "dp":
        strategy = lightning_clapping.ClappingStrategy(stages=2, microbatches=2)
        batch_size = 4
    else:
        raise SystemExit(f"unknown case {case!r}")
    inputs = Inputs()
    trainer = L.Trainer(accelerator="cpu", num_nodes=2, devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                        callbacks=[inputs], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False))
    held = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}
    torch.save({"node_rank": trainer.node_rank, "local_rank": trainer.local_rank,
                "environment": type(trainer.strategy.cluster_environment).__name__,
                "inputs": inputs.batches, "params": held}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    # the interpreter's final garbage collections over torch's and Lightning's objects took 15 s per process on a
    # loaded 2-core machine; nothing needs collecting once the results are written
    gc.freeze()
