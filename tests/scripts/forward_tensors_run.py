"""A small GPT whose modules build tensors inside forward (no ``device=``), trained a few steps.

python forward_tensors_run.py MODE OUT     MODE: "pipe" (3 stages, cut at blocks.1 and blocks.2) or "single"

Every block builds its causal mask with ``torch.triu(torch.ones(T, T), diagonal=1).bool()``; the embedding module
(stage 0) makes its position ids with ``torch.arange(T)``; blocks 1 and 3 apply a rotary table computed in forward
(block 1 keeps its inverse frequencies as a plain tensor attribute, not a buffer, which the meta device cannot mix
with and fake tensors can). Stages 1 and 2 skip those modules and must still learn their output shapes.

Writes OUT/forward_tensors_MODE.json (the step losses, from rank 0) and OUT/forward_tensors_MODE.pt (final weights).
"""

import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from _models import fit_and_save

VOCAB, T, D, HEADS = 11, 6, 16, 2


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(T, D)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1])  # built in forward, no device=
        return self.tok(idx) + self.pos(positions)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Block(nn.Module):
    def __init__(self, rotary: str | None = None) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.rotary = rotary
        hd = D // HEADS
        if rotary == "attribute":  # a plain attribute: it stays on the CPU when the module moves to the meta device
            self.inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))

    def rope(self, q, k):
        n, hd = q.shape[-2], q.shape[-1]
        if self.rotary == "attribute":
            inv_freq = self.inv_freq
        else:
            inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(n).float(), inv_freq)
        table = torch.cat([freqs, freqs], dim=-1)
        cos, sin = table.cos(), table.sin()
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def forward(self, x):
        b, n, c = x.shape
        mask = torch.triu(torch.ones(n, n), diagonal=1).bool()  # built in forward, no device=
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (t.view(b, n, HEADS, c // HEADS).transpose(1, 2) for t in (q, k, v))
        if self.rotary:
            q, k = self.rope(q, k)
        att = (q @ k.transpose(-2, -1)) * (c // HEADS) ** -0.5
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class ForwardTensorsGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList([Block(), Block("attribute"), Block(), Block("computed")])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        h = self.embed(idx)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln_f(h))

    def training_step(self, batch, batch_idx):
        idx, y = batch
        return F.cross_entropy(self(idx).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(mode: str, out: Path) -> None:
    torch.manual_seed(0)
    model = ForwardTensorsGPT()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (24, T), generator=g)
    y = torch.randint(0, VOCAB, (24, T), generator=g)
    fit_and_save(model, DataLoader(TensorDataset(idx, y), batch_size=8), mode, ["blocks.1", "blocks.2"], out,
                 "forward_tensors")

if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
