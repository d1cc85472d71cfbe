"""A tensor tied across stages whose copies configure_optimizers puts in parameter groups with different settings
(groups built by name: decay / no decay) is refused at setup, with the tensor, the groups and what to do; tied copies
in groups with the same settings train, and stay identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import launch_forked


def _tied_fit(out: str, grouping: str) -> None:
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
            # by name, as GPT training scripts do: embeddings (and biases) without weight decay
            no_decay = {"name": lambda n: n.startswith("emb.") or n.endswith("bias"),
                        "tensor": lambda n: n in ("emb.weight", "head.weight") or n.endswith("bias")}[grouping]
            named = list(self.named_parameters())
            return torch.optim.AdamW([{"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.5},
                                      {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}], lr=0.05)

    class Copies(L.Callback):
        def on_train_end(self, trainer, module):
            params = dict(module.named_parameters(remove_duplicate=False))
            self.copies = {k: params[k].detach().tolist() for k in ("emb.weight", "head.weight")
                           if not params[k].is_meta}

    L.seed_everything(0, verbose=False)
    x = (torch.randint(0, 10, (32, 1), generator=torch.Generator().manual_seed(1)) + torch.arange(6)) % 10
    copies = Copies()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ClappingStrategy(split_points=["blocks"], microbatches=2),
                        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[copies])
    trainer.fit(TiedLM(), DataLoader(TensorDataset(x), batch_size=8))
    Path(out, f"{grouping}_{trainer.global_rank}.json").write_text(json.dumps(copies.copies))


def test_tied_copies_in_param_groups_with_different_settings_are_refused_at_setup(tmp_path):
    proc = launch_forked(_tied_fit, str(tmp_path), "name", ranks=2, cwd=tmp_path, expect_ok=False, timeout=200)
    assert proc.returncode != 0 and not proc.timed_out, "trained: the copies of the tied tensor drift apart"
    for said in ("the tied tensor 'emb.weight' / 'head.weight'",
                 "stage 0 steps 'emb.weight' in optimizer 0, param group 1, weight_decay=0.0",
                 "stage 1 steps 'head.weight' in optimizer 0, param group 0, weight_decay=0.5",
                 "Put all of 'emb.weight' and 'head.weight' in the same parameter group"):
        assert said in proc.stderr
    assert not list(tmp_path.glob("name_*.json"))  # refused before any step


def test_tied_copies_in_one_param_group_train_and_stay_identical(tmp_path):
    launch_forked(_tied_fit, str(tmp_path), "tensor", ranks=2, cwd=tmp_path, timeout=200)
    copies = [torch.tensor(v) for r in (0, 1) for v in json.loads((tmp_path / f"tensor_{r}.json").read_text()).values()]
    assert len(copies) == 2 and torch.equal(copies[0], copies[1])
