"""After a "full" fit the launching process's module holds the whole model with a tensor tied across stages tied
again; its optimizer lists that tensor once (as one process does), so a later optimizer.step() steps it once and the
optimizer's state dict fits a one-process optimizer of the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import launch_forked


def _fit_then_step(out: str) -> None:
    import lightning as L
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_clapping import ClappingStrategy

    class TiedLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.blocks(self.emb(x)))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return F.cross_entropy(self(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    L.seed_everything(0, verbose=False)
    model = TiedLM()
    x = (torch.randint(0, 10, (32, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(6)) % 10
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ClappingStrategy(split_points=["blocks"], microbatches=2),
                        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(x), batch_size=8))
    if trainer.global_rank != 0:  # the launching process: the whole model is back in its module
        return
    optimizer = trainer.optimizers[0]
    tied = model.emb.weight
    row = {"tied": tied is model.head.weight,
           "groups": [[len(g["params"]), len(set(map(id, g["params"])))] for g in optimizer.param_groups],
           "trained_state": "momentum_buffer" in optimizer.state.get(tied, {})}
    try:  # the optimizer's state as one process's optimizer of this model reads it
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(optimizer.state_dict())
        row["loads"] = "ok"
    except ValueError as err:
        row["loads"] = str(err)
    # one more step by hand: the tied tensor gets one update
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tied.grad = torch.ones_like(tied)
    buf = optimizer.state[tied]["momentum_buffer"].clone() if row["trained_state"] else torch.zeros_like(tied)
    expected = tied.detach() - 0.1 * (0.9 * buf + 1)
    optimizer.step()
    row["one_update"] = torch.allclose(tied.detach(), expected, rtol=0, atol=1e-6)
    Path(out, "after.json").write_text(json.dumps(row))


def test_after_fit_the_optimizer_lists_the_retied_tensor_once_and_steps_it_once(tmp_path):
    launch_forked(_fit_then_step, str(tmp_path), ranks=2, cwd=tmp_path, timeout=200)
    row = json.loads((tmp_path / "after.json").read_text())
    assert row["tied"] is True
    assert all(n == unique for n, unique in row["groups"]), row["groups"]  # every parameter listed once
    assert row["trained_state"]  # the state of the copy that was trained, not the released one's
    assert row["loads"] == "ok", row["loads"]
    assert row["one_update"] is True
