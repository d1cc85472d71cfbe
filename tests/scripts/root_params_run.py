"""Parameters registered directly on the LightningModule (a learned position table, an output scale).

python root_params_run.py OUT CASE MODE      CASE: owned | twice      MODE: pipe (3 stages) | single

owned: ``self.pos`` is used by the first stage only, ``self.out_scale`` by the last only; Lightning's defaults
       (checkpointing on). Rank 0 saves the losses, the final weights and the checkpoint's weights.
twice: ``self.scale`` is used at the start and at the end of forward, i.e. on two stages (must be refused).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import Recorder, lm_data


class PosLM(L.LightningModule):
    def __init__(self, vocab: int = 32, d: int = 16, block: int = 16, twice: bool = False):
        super().__init__()
        self.twice = twice
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.1 * torch.randn(block, d))
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, vocab)
        self.out_scale = nn.Parameter(torch.ones(()))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = torch.tanh(block(x))
        logits = self.head(x) * self.out_scale
        return logits + self.pos.sum() if self.twice else logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


def main(out: Path, case: str, mode: str) -> None:
    L.seed_everything(0)
    model = PosLM(twice=case == "twice")
    x, y = lm_data(n=32, vocab=32, block=16, seed=3)
    pipe = mode == "pipe"
    strategy = lightning_clapping.ClappingStrategy(split_points=["blocks.0", "blocks.1"], microbatches=2) \
        if pipe else "auto"
    rec = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=3 if pipe else 1, strategy=strategy, max_steps=4,
                        default_root_dir=out / mode, callbacks=[rec], enable_progress_bar=False)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    if trainer.global_rank == 0:
        saved = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)["state_dict"]
        torch.save({"weights": model.state_dict(), "checkpoint": saved}, out / f"{case}_{mode}.pt")
        (out / f"{case}_{mode}.json").write_text(json.dumps({"losses": rec.losses}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
