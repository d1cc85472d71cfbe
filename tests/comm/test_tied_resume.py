"""A tied tensor whose copies sit on non-adjacent stages (input embedding on stage 0, output head on stage 2; the
middle stage holds neither copy) with an optimizer of several parameter groups: the pipeline's checkpoint holds the
optimizer state one process would have, parameter by parameter, and a run resumed from it (full or sharded)
continues as an uninterrupted one-process run."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import launch_forked

SPLIT = ["blocks.1", "blocks.2"]  # stage 0: emb, blocks.0; stage 1: blocks.1; stage 2: blocks.2, norm, head


class TiedHeadLM(L.LightningModule):
    def __init__(self, vocab: int = 11, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        logits = self(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))

    def configure_optimizers(self):  # the common pattern: weight decay on matrices, none on biases and norms
        named = list(self.named_parameters())
        groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=0.02)


def one_process_names() -> list[str]:
    """The parameter name of each position of the optimizer state one process saves."""
    model = TiedHeadLM()
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in model.configure_optimizers().param_groups for p in g["params"]]


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def _fit(out: Path, name: str, strategy, devices: int, epochs: int, resume: str | None = None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0)
    model = TiedHeadLM()
    x = torch.randint(0, 11, (24, 7), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x), batch_size=8)
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs, logger=False,
                        callbacks=[record, ModelCheckpoint(dirpath=out / name, filename="{epoch}", save_top_k=-1)],
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out / name)
    trainer.fit(model, data, ckpt_path=resume)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out / f"{name}_weights.pt")
        (out / f"{name}_losses.json").write_text(json.dumps(record.losses))


def _single(out):
    _fit(Path(out), "single", "auto", 1, 2)  # saves the checkpoint of epoch 0 on the way


def _pipe(out, kind):
    """3 stages train one epoch and save a ``kind`` checkpoint; new trainers resume it for a second epoch."""
    import lightning_clapping

    out = Path(out)
    strategy = lightning_clapping.ClappingStrategy(split_points=SPLIT, microbatches=2, state_dict_type=kind)
    _fit(out, f"pipe_{kind}", strategy, 3, 1)
    # resumed by a "full" strategy: its launching process then holds the whole trained model
    strategy = lightning_clapping.ClappingStrategy(split_points=SPLIT, microbatches=2)
    _fit(out, f"resumed_{kind}", strategy, 3, 2, resume=str(out / f"pipe_{kind}" / "epoch=0.ckpt"))


SPLITS = {1: None, 2: ["blocks.2"], 3: SPLIT}


def _save_on_one(out):
    """One epoch in one process with the strategy, and its sharded checkpoint."""
    import lightning_clapping

    strategy = lightning_clapping.ClappingStrategy(microbatches=2, state_dict_type="sharded")
    _fit(Path(out), "pipe_sharded_on_1", strategy, 1, 1)


def _resume_elsewhere(out, saved_on, stages):
    """The sharded checkpoint written on ``saved_on`` stages resumed on ``stages`` (1: one process, with the
    strategy)."""
    import lightning_clapping

    out = Path(out)
    folder = "pipe_sharded" if saved_on == 3 else f"pipe_sharded_on_{saved_on}"
    strategy = lightning_clapping.ClappingStrategy(split_points=SPLITS[stages], microbatches=2)
    _fit(out, f"resumed_{saved_on}_on_{stages}", strategy, stages, 2, resume=str(out / folder / "epoch=0.ckpt"))


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """The one-process reference: two epochs, the checkpoint of the first saved on the way."""
    out = tmp_path_factory.mktemp("tied_resume")
    launch_forked(_single, str(out), ranks=1, cwd=out, timeout=300)
    return out


@pytest.fixture(scope="module")
def runs(out):
    """``runs(kind)``: the folder, once the pipeline's run with a ``kind`` checkpoint and its resumption are done."""
    done = set()

    def run(kind):
        if kind not in done:
            done.add(kind)
            launch_forked(_pipe, str(out), kind, ranks=3, cwd=out, timeout=400)
        return out

    return run


def test_the_full_checkpoint_holds_the_one_process_optimizer_state_of_every_parameter(runs):
    runs = runs("full")
    names = one_process_names()
    single = torch.load(runs / "single" / "epoch=0.ckpt", weights_only=False)["optimizer_states"][0]
    pipe = torch.load(runs / "pipe_full" / "epoch=0.ckpt", weights_only=False)["optimizer_states"][0]
    assert pipe["param_groups"] == single["param_groups"]
    assert sorted(pipe["state"]) == sorted(single["state"]) == list(range(len(names)))
    for i, name in enumerate(names):
        for key, expected in single["state"][i].items():
            torch.testing.assert_close(pipe["state"][i][key], expected, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name, key=key: f"{name} {key}: {m}")


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_run_resumed_from_the_pipeline_checkpoint_continues_as_an_uninterrupted_run(runs, kind):
    runs = runs(kind)
    single = torch.load(runs / "single_weights.pt")
    resumed = torch.load(runs / f"resumed_{kind}_weights.pt")
    assert set(resumed) == set(single)
    for name in single:
        torch.testing.assert_close(resumed[name], single[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    losses = json.loads((runs / f"resumed_{kind}_losses.json").read_text())
    assert losses == pytest.approx(json.loads((runs / "single_losses.json").read_text())[3:], abs=1e-5)


@pytest.mark.parametrize(("saved_on", "stages"), [(3, 2), (3, 1), (1, 3)])
def test_a_sharded_checkpoint_resumes_on_another_number_of_stages(runs, saved_on, stages):
    # sharded checkpoints resume "on any number of stages": the tied tensor's copies and their optimizer state
    # land wherever the new cut puts them (one process holds the tensor once, the end stages a copy each)
    runs = runs("sharded")
    if saved_on == 1:
        launch_forked(_save_on_one, str(runs), ranks=1, cwd=runs, timeout=300)
    launch_forked(_resume_elsewhere, str(runs), saved_on, stages, ranks=stages, cwd=runs, timeout=300)
    single = torch.load(runs / "single_weights.pt")
    resumed = torch.load(runs / f"resumed_{saved_on}_on_{stages}_weights.pt")
    for name in single:
        torch.testing.assert_close(resumed[name], single[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    losses = json.loads((runs / f"resumed_{saved_on}_on_{stages}_losses.json").read_text())
    assert losses == pytest.approx(json.loads((runs / "single_losses.json").read_text())[3:], abs=1e-5)
