"""Real Lightning projects drop in unchanged: ``import pytorch_lightning as pl`` projects, LightningCLI configs and
Hydra configs select ClappingStrategy, and train as on one device.

Every run is a script started the way users start it (``python script.py ...``; Lightning's launcher starts the
second rank), with Lightning's defaults, 2 stages, and compared with a single-device run of the same model, data,
seed and optimizer (the ``single`` fixture).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, launch

CONFIGS = ROOT / "examples" / "configs"
TWIN = "lightning_clapping.pytorch_lightning"
LIGHTNING_STRATEGY = "lightning_clapping.strategy.ClappingStrategy"
TWIN_STRATEGY = f"{TWIN}.strategy.ClappingStrategy"


def _need_cli() -> None:
    from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE

    if not _JSONARGPARSE_SIGNATURES_AVAILABLE:
        pytest.skip("LightningCLI needs jsonargparse: python -m pip install 'jsonargparse[signatures]>=4.39,<5'")


def _need_hydra() -> None:
    if importlib.util.find_spec("hydra") is None or importlib.util.find_spec("omegaconf") is None:
        pytest.skip("needs Hydra: python -m pip install 'hydra-core>=1.2,<2'")


def _need_pytorch_lightning() -> None:
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("needs pytorch_lightning: python -m pip install 'pytorch-lightning>=2.6,<2.7'")


def _load(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def single() -> dict:
    return _single_device_reference()


def _single_device_reference() -> dict:
    """The reference, trained here on one device in plain torch: the scripts' MLP, data, seed and optimizer, with
    Lightning's defaults (2 epochs of 3 batches; validation after each epoch, its values averaged over samples)."""
    from torch.nn import functional as F

    from _models import SequentialMLP, classification_data

    torch.manual_seed(0)
    model = SequentialMLP()
    optimizer = model.configure_optimizers()
    x, y = classification_data(n=48, seed=1)
    xv, yv = classification_data(n=32, seed=2)
    losses = []
    for _ in range(2):
        for i in range(0, 48, 16):
            loss = F.cross_entropy(model(x[i:i + 16]), y[i:i + 16])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            logits = model(xv)
    return {
        "losses": losses,
        "callback_metrics": {"train_loss": losses[-1], "val_loss": float(F.cross_entropy(logits, yv)),
                             "val_acc": float((logits.argmax(-1) == yv).float().mean())},
        "weights": {k: v.tolist() for k, v in model.state_dict().items()},
    }


def _assert_same_training(run: dict, ref: dict) -> None:
    assert run["stages"] == 2
    assert len(run["losses"]) == len(ref["losses"]) == 6
    assert run["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    for key in ("train_loss", "val_loss", "val_acc"):
        assert run["callback_metrics"][key] == pytest.approx(ref["callback_metrics"][key], abs=1e-5), key
    assert run["weights"].keys() == ref["weights"].keys()
    for k in ref["weights"]:  # the launching process's module holds the whole trained model afterwards
        torch.testing.assert_close(torch.tensor(run["weights"][k]), torch.tensor(ref["weights"][k]), rtol=1e-5,
                                   atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert run["callback_metrics"]["clapping/bytes"] > 0  # the strategy's own per-step numbers reached rank 0


# ------------------------------------------------------------------------------------------ (i) pytorch_lightning
@pytest.fixture(scope="module")
def pl_runs(tmp_path_factory):
    """One launch, two runs (strategy="clapping", then the twin's ClappingStrategy object); each test reads its
    own."""
    _need_pytorch_lightning()
    out = tmp_path_factory.mktemp("plns")
    proc = launch("plns_fit.py", "pipe", str(out), cwd=out, expect_ok=False)

    def result(name: str) -> dict:
        if not (out / f"{name}.json").exists():
            pytest.fail(f"plns_fit.py made no {name!r} run (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                        f"{proc.stderr[-5000:]}")
        return _load(out, name)

    return result


def test_pytorch_lightning_trainer_takes_strategy_name(pl_runs, single):
    run = pl_runs("string")  # pl.Trainer(strategy="clapping") after `import lightning_clapping`
    assert run["strategy"] == TWIN_STRATEGY
    _assert_same_training(run, single)


def test_pytorch_lightning_trainer_takes_strategy_object(pl_runs, single):
    run = pl_runs("object")  # pl.Trainer(strategy=lightning_clapping.pytorch_lightning.ClappingStrategy(...))
    assert run["strategy"] == TWIN_STRATEGY
    _assert_same_training(run, single)


def test_registered_in_both_registries_and_twin_shares_lightning_free_modules():
    _need_pytorch_lightning()
    import lightning.pytorch as L
    import pytorch_lightning as pl

    import lightning_clapping
    import lightning_clapping.pytorch_lightning as twin

    assert isinstance(L.strategies.StrategyRegistry.get("clapping"), lightning_clapping.ClappingStrategy)
    made = pl.strategies.StrategyRegistry.get("clapping")
    assert isinstance(made, twin.ClappingStrategy) and isinstance(made, pl.strategies.ParallelStrategy)
    assert issubclass(twin.LazySamplingDataModule, pl.LightningDataModule)
    # the twin is this package under the other namespace: every public name, the Lightning-free ones shared
    for name in lightning_clapping.__all__:
        assert hasattr(twin, name), name
    assert twin.get_codec is lightning_clapping.get_codec and twin.Codec is lightning_clapping.Codec
    assert twin.SplitError is lightning_clapping.SplitError
    # nothing in the twin still refers to lightning.pytorch / lightning.fabric
    for mod in [m for n, m in sys.modules.items() if n.startswith(TWIN + ".")]:
        for attr, value in vars(mod).items():
            home = getattr(value, "__module__", None) or getattr(value, "__name__", "")
            assert not str(home).startswith(("lightning.pytorch", "lightning.fabric")), (mod.__name__, attr, home)


def test_registration_does_not_import_pytorch_lightning_when_absent(monkeypatch):
    from lightning_clapping import _namespaces

    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)  # find_spec: None; any import: ImportError
    assert importlib.util.find_spec("pytorch_lightning") is None
    assert _namespaces.register_pytorch_lightning() is False
    _namespaces.register()  # what `import lightning_clapping` runs: fine without pytorch_lightning


# ------------------------------------------------------------------------------------------ (ii) LightningCLI
def test_lightning_cli_yaml_class_path_selects_strategy_without_import(tmp_path, single):
    _need_cli()
    launch("cli_fit.py", str(tmp_path), "fit", "--config", str(CONFIGS / "cli_clapping.yaml"), cwd=tmp_path)
    run = _load(tmp_path, "cli_pipe")
    assert run["imported_before"] is False  # the script never imports lightning_clapping itself
    assert run["strategy"] == LIGHTNING_STRATEGY
    _assert_same_training(run, single)


def test_lightning_cli_command_line_forms(monkeypatch):
    """The one-flag forms, parsed in-process (no run): a class path plus an init arg, for either namespace."""
    _need_cli()
    monkeypatch.setattr(sys, "argv", ["train.py"])
    _need_pytorch_lightning()
    from lightning.pytorch.cli import LightningCLI
    from pytorch_lightning.cli import LightningCLI as PLLightningCLI

    from _models import SequentialMLP

    defaults = {"accelerator": "cpu", "devices": 2, "logger": False}
    cli = LightningCLI(SequentialMLP, run=False, trainer_defaults=defaults, args=[
        "--trainer.strategy", "lightning_clapping.ClappingStrategy", "--trainer.strategy.microbatches", "2"])
    strategy = cli.trainer.strategy
    assert f"{type(strategy).__module__}.{type(strategy).__qualname__}" == LIGHTNING_STRATEGY
    assert strategy.microbatches == 2

    import pytorch_lightning as pl

    class PLModel(pl.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()

    cli = PLLightningCLI(PLModel, run=False, trainer_defaults=defaults, args=[
        "--trainer.strategy", '{"class_path": "lightning_clapping.pytorch_lightning.ClappingStrategy", '
        '"init_args": {"split_points": ["net.4"]}}'])
    strategy = cli.trainer.strategy
    assert f"{type(strategy).__module__}.{type(strategy).__qualname__}" == TWIN_STRATEGY
    assert strategy.split_points == ["net.4"]


# ------------------------------------------------------------------------------------------ (iii) Hydra
def test_hydra_instantiate_yaml_target_selects_strategy_without_import(tmp_path, single):
    _need_hydra()
    launch("hydra_fit.py", str(tmp_path), str(CONFIGS / "hydra_clapping.yaml"), cwd=tmp_path)
    run = _load(tmp_path, "hydra_pipe")
    assert run["imported_before"] is False
    assert run["strategy"] == LIGHTNING_STRATEGY
    assert run["twin_built"] is False  # a lightning.pytorch project never compiles the pytorch_lightning twin
    _assert_same_training(run, single)


def test_hydra_target_for_pytorch_lightning_trainer():
    _need_hydra()
    _need_pytorch_lightning()
    import pytorch_lightning as pl
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(CONFIGS / "hydra_clapping.yaml")
    cfg.trainer._target_ = "pytorch_lightning.Trainer"
    cfg.trainer.strategy._target_ = f"{TWIN}.ClappingStrategy"
    trainer = instantiate(cfg.trainer, logger=False)
    assert isinstance(trainer, pl.Trainer)
    assert f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__qualname__}" == TWIN_STRATEGY
    assert trainer.strategy.split_points == ["net.4"] and trainer.strategy.num_stages == 2


