"""A Hydra-style project that never imports lightning_clapping: ``hydra.utils.instantiate`` builds the Trainer and
its strategy from a YAML config (the one users copy, examples/configs/hydra_clapping.yaml).

python hydra_fit.py OUT CONFIG
"""

import json
import sys
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from _models import Recorder, SequentialMLP, classification_data
from cli_fit import result

if __name__ == "__main__":
    out, config = Path(sys.argv[1]), sys.argv[2]
    imported_before = "lightning_clapping" in sys.modules
    cfg = OmegaConf.load(config)
    rec = Recorder()
    trainer = instantiate(cfg.trainer, max_epochs=2, callbacks=[rec], logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    L.seed_everything(0)
    model = SequentialMLP()
    trainer.fit(model, DataLoader(TensorDataset(*classification_data(n=48, seed=1)), batch_size=16),
                DataLoader(TensorDataset(*classification_data(n=32, seed=2)), batch_size=16))
    if trainer.global_rank == 0:
        res = result(trainer, model, rec, imported_before)
        res["twin_built"] = any(m.startswith("lightning_clapping.pytorch_lightning") for m in sys.modules)
        (out / "hydra_pipe.json").write_text(json.dumps(res))
