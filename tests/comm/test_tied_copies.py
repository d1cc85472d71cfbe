"""The stages' copies of a tensor tied across a cut stay one tensor for the optimizer.

* Copies that configure_optimizers puts in parameter groups with different settings (groups built by name: decay /
  no decay) are refused at setup, with the tensor, the groups and what to do; copies in one group train and stay
  identical.
* After fit, the launching process's optimizer lists the re-tied tensor once, with the state of the trained copy,
  so its state loads into one process's optimizer and another step updates the tensor once.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from conftest import launch_forked


class TiedLM(L.LightningModule):
    """An embedding tied to the output head, cut at ``blocks``; ``optimizer(module)`` builds its optimizer."""

    def __init__(self, optimizer):
        super().__init__()
        self.make_optimizer = optimizer
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
        return self.make_optimizer(self)


def _fit(model: TiedLM, steps: int, callbacks: list | None = None) -> L.Trainer:
    from lightning_clapping import ClappingStrategy

    L.seed_everything(0, verbose=False)
    x = (torch.randint(0, 10, (32, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(6)) % 10
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ClappingStrategy(split_points=["blocks"], microbatches=2),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks or [])
    trainer.fit(model, DataLoader(TensorDataset(x), batch_size=8))
    return trainer


# ------------------------------------------------------------------------------------------ parameter groups
def _grouped_adamw(grouping: str):
    # by name, as GPT training scripts do: embeddings (and biases) without weight decay; or by tensor
    no_decay = {"name": lambda n: n.startswith("emb.") or n.endswith("bias"),
                "tensor": lambda n: n in ("emb.weight", "head.weight") or n.endswith("bias")}[grouping]

    def make(module):
        named = list(module.named_parameters())
        return torch.optim.AdamW([{"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.5},
                                  {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}], lr=0.05)

    return make


class Copies(L.Callback):
    def on_train_end(self, trainer, module):
        params = dict(module.named_parameters(remove_duplicate=False))
        self.copies = {k: params[k].detach().tolist() for k in ("emb.weight", "head.weight") if not params[k].is_meta}


def _grouped_fit(out: str, grouping: str) -> None:
    copies = Copies()
    trainer = _fit(TiedLM(_grouped_adamw(grouping)), 4, [copies])
    Path(out, f"{grouping}_{trainer.global_rank}.json").write_text(json.dumps(copies.copies))


def test_tied_copies_in_param_groups_with_different_settings_are_refused_at_setup(tmp_path):
    proc = launch_forked(_grouped_fit, str(tmp_path), "name", ranks=2, cwd=tmp_path, expect_ok=False, timeout=200)
    assert proc.returncode != 0 and not proc.timed_out, "trained: the copies of the tied tensor drift apart"
    for said in ("the tied tensor 'emb.weight' / 'head.weight'",
                 "stage 0 steps 'emb.weight' in optimizer 0, param group 1, weight_decay=0.0",
                 "stage 1 steps 'head.weight' in optimizer 0, param group 0, weight_decay=0.5",
                 "Put all of 'emb.weight' and 'head.weight' in the same parameter group"):
        assert said in proc.stderr
    assert not list(tmp_path.glob("name_*.json"))  # refused before any step


def test_tied_copies_in_one_param_group_train_and_stay_identical(tmp_path):
    launch_forked(_grouped_fit, str(tmp_path), "tensor", ranks=2, cwd=tmp_path, timeout=200)
    copies = [torch.tensor(v) for r in (0, 1) for v in json.loads((tmp_path / f"tensor_{r}.json").read_text()).values()]
    assert len(copies) == 2 and torch.equal(copies[0], copies[1])


# ------------------------------------------------------------------------------------------ after fit
def _fit_then_step(out: str) -> None:
    model = TiedLM(lambda module: torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    trainer = _fit(model, 3)
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
