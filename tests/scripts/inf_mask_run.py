"""A model whose boundary carries an additive float causal mask holding -inf, trained a few steps.

python inf_mask_run.py MODE OUT     MODE: "pipe" (2 stages, cut at blocks.1) or "single"

Writes OUT/inf_mask_MODE.json (the step losses, from rank 0) and OUT/inf_mask_MODE.pt (the final weights).
"""

import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from _models import fit_and_save


class MaskedEncoder(L.LightningModule):
    """Input projection, a ModuleList of encoder layers run in a loop with a float -inf causal mask, a head."""

    def __init__(self, d_in: int = 4, d: int = 16, layers: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)  # 0 and -inf
        h = self.proj(x)
        for blk in self.blocks:
            h = blk(h, src_mask=mask)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(mode: str, out: Path) -> None:
    torch.manual_seed(0)
    model = MaskedEncoder()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 6, 4, generator=g), torch.randint(0, 3, (24, 6), generator=g)
    fit_and_save(model, DataLoader(TensorDataset(x, y), batch_size=8), mode, ["blocks.1"], out, "inf_mask")

if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
