"""A LightningCLI project that never imports lightning_clapping: the strategy comes from a YAML config.

python cli_fit.py OUT fit --config examples/configs/cli_clapping.yaml [--trainer.devices 1 --trainer.strategy auto]
"""

import json
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

from _models import Recorder, SequentialMLP, classification_data


class TinyData(L.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(*classification_data(n=48, seed=1)), batch_size=16)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*classification_data(n=32, seed=2)), batch_size=16)


def result(trainer, model, rec, imported_before):
    return {
        "losses": rec.losses,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "strategy": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__qualname__}",
        "stages": getattr(trainer.strategy, "num_stages", 1),  # processes; trainer.world_size counts replicas
        "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        "imported_before": imported_before,
    }


if __name__ == "__main__":
    out, args = Path(sys.argv[1]), sys.argv[2:]
    imported_before = "lightning_clapping" in sys.modules
    rec = Recorder()
    cli = LightningCLI(
        SequentialMLP, TinyData, args=args, seed_everything_default=0, save_config_kwargs={"overwrite": True},
        trainer_defaults={"max_epochs": 2, "callbacks": [rec], "logger": False, "enable_checkpointing": False,
                          "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0},
    )
    if cli.trainer.global_rank == 0:
        name = "cli_pipe" if getattr(cli.trainer.strategy, "num_stages", 1) > 1 else "cli_single"
        (out / f"{name}.json").write_text(json.dumps(result(cli.trainer, cli.model, rec, imported_before)))
