"""The GPU path keeps NCCL's contract: the end-to-end paths, run on CPU processes under :mod:`nccl_contract`.

One launch of 4 processes runs, in the same processes one after the other (as several scripts would):

* 4 stages (the middle ones talk to two neighbours; a tied embedding and head make the first and the last stage sum
  their gradients): training with every variant (uncompressed under 16-mixed with clipping, direct with autotune, ef21,
  aqsgd, clapping-fc and clapping-fu under lazy sampling), a full and a sharded checkpoint each resumed, then
  validate, test and predict;
* 2 stages x 2 replicas: training with validation (``sync_dist``), clipping, and a full checkpoint.

All runs use ``prepost_receives=False``, the NCCL path (messages matched by their order). Every rank records its
``torch.distributed`` calls; the test process judges all ranks' records together (:func:`nccl_contract.judge`).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nccl_contract
from conftest import launch_forked

VOCAB, SEQ, N = 16, 4, 32


class TiedNet(L.LightningModule):
    """Tokens -> embedding -> an MLP -> a head that shares the embedding's weight (GPT-2's tie, in small)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh())
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.body(self.emb(x).mean(1)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


SPLITS = {4: ["body.0", "body.2", "head"], 2: ["body.2"]}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, VOCAB, (N, SEQ), generator=g), torch.randint(0, VOCAB, (N,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))


def _trainer(stages: int, steps: int, **strategy_kwargs) -> L.Trainer:
    from lightning_clapping import ClappingStrategy

    clip = strategy_kwargs.pop("clip", None)
    plugins = []
    if strategy_kwargs.pop("fp16", False):  # a loss scale shared by all stages (precision.SharedLossScale)
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    strategy = ClappingStrategy(split_points=SPLITS[stages], microbatches=2, prepost_receives=False,
                                liveness=None, **strategy_kwargs)
    return L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=1,
                     gradient_clip_val=clip, plugins=plugins)


def _fit(stages: int, steps: int, p: float | None = None, ckpt: Path | None = None, save: Path | None = None,
         **kw) -> L.Trainer:
    from lightning_clapping import LazySamplingDataModule

    torch.manual_seed(0)
    trainer = _trainer(stages, steps, **kw)
    data = _loader() if p is None else LazySamplingDataModule(_loader(), p=p, seed=3)
    trainer.fit(TiedNet(), data, ckpt_path=str(ckpt) if ckpt else None)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer


def _scenarios(out: Path) -> None:
    """What every rank runs (the module docstring)."""
    q = {"forward_codec": "q4", "backward_codec": "q8"}
    _fit(4, 2, variant="uncompressed", clip=1.0, fp16=True)
    _fit(4, 3, variant="direct", autotune=True, **q)
    _fit(4, 2, variant="ef21", **q)
    _fit(4, 2, p=1.0, variant="aqsgd", **q)
    _fit(4, 2, p=0.5, variant="clapping-fc", **q)
    trainer = _fit(4, 2, p=0.5, variant="clapping-fu", **q)
    model = trainer.lightning_module
    eval_trainer = _trainer(4, 1, variant="direct", compress_eval=True, **q)
    eval_trainer.validate(model, _loader())
    eval_trainer.test(model, _loader())
    eval_trainer.predict(model, _loader())
    # 2 stages x 2 replicas: checkpoints saved and resumed, in both layouts
    _fit(2, 2, p=0.5, variant="clapping-fc", clip=1.0, save=out / "fc.ckpt", **q)
    _fit(2, 3, p=0.5, variant="clapping-fc", clip=1.0, ckpt=out / "fc.ckpt", **q)
    _fit(2, 2, variant="ef21", state_dict_type="sharded", save=out / "sharded", **q)
    _fit(2, 3, variant="ef21", state_dict_type="sharded", ckpt=out / "sharded", **q)


def _rank_main(out: str) -> None:
    """One rank: record its calls while it runs the scenarios, then write them down."""
    contract = nccl_contract.Contract() if os.environ.get("NO_CONTRACT") else nccl_contract.Contract.install()
    try:
        _scenarios(Path(out))
    finally:
        contract.uninstall() if contract._patched else None
        contract.dump(Path(out) / f"rank{os.environ['LOCAL_RANK']}.json", int(os.environ["LOCAL_RANK"]))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("nccl_contract")
    launch_forked(_rank_main, str(out), ranks=4, cwd=out, timeout=240)
    return nccl_contract.load(out)


def test_every_distributed_call_of_the_end_to_end_paths_keeps_nccls_contract(records):
    assert len(records) == 4
    problems = nccl_contract.judge(records)
    assert not problems, "\n".join(problems[:20])
