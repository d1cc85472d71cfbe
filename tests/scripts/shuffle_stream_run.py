"""Two stages that use torch's global RNG differently, over a DataLoader that shuffles with it (the reported case).

python shuffle_stream_run.py OUT CASE[,CASE...]      CASE: plain | lazy

A DataLoader with ``shuffle=True`` and no ``generator=``, dropout on the first stage only (so the stages draw
different amounts from the global RNG), ``freeze_rng=False``; ``plain`` trains on the loader itself, ``lazy`` through
``LazySamplingDataModule(p=0.5)``. 2 epochs of 4 batches; each rank records the labels of every batch it trained on.
The cases run one after the other in the same processes.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import classification_data
from fidelity_run import Labels, NetHolder


def main(out: Path, case: str) -> None:
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(*classification_data(n=64, seed=1)), batch_size=16, shuffle=True)
    model = NetHolder(nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 4)))
    labels = Labels()
    strategy = lightning_clapping.ClappingStrategy(split_points=["net.3"], microbatches=2, freeze_rng=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[labels])
    data = lightning_clapping.LazySamplingDataModule(loader, p=0.5, seed=1) if case == "lazy" else None
    trainer.fit(model, loader if data is None else None, datamodule=data)
    (out / f"{case}_rank{trainer.global_rank}.json").write_text(json.dumps(labels.rows))


if __name__ == "__main__":
    for name in sys.argv[2].split(","):
        main(Path(sys.argv[1]), name)
