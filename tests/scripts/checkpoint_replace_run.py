"""Checkpoints of both types saved one after the other at the same path by a 2-stage run, then resumed from.

python checkpoint_replace_run.py OUT
    trains 2 steps, saves at OUT/model.ckpt as full, sharded, full, sharded (each replacing the one before), then
    resumes from that sharded folder in a new Trainer (torch's default weights_only) and trains to step 4. Global
    rank 0 writes OUT/replace.json: per save, [type, a file is there, a sharded folder is there, the names in OUT].
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data
from lightning_clapping.checkpoint.state import is_sharded_checkpoint


def trainer(state_dict_type, max_steps):
    strategy = lightning_clapping.ClappingStrategy(split_points=["net.4"], microbatches=2,
                                                   state_dict_type=state_dict_type)
    return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def main(out):
    x, y = classification_data(n=32, seed=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    torch.manual_seed(0)
    first = trainer("full", 2)
    first.fit(SequentialMLP(), loader)
    path, seen = out / "model.ckpt", []
    for kind in ["full", "sharded", "full", "sharded"]:
        first.strategy.options.state_dict_type = kind
        first.save_checkpoint(path)
        seen.append([kind, path.is_file(), is_sharded_checkpoint(path), sorted(p.name for p in out.iterdir())])
    again = trainer("sharded", 4)
    again.fit(SequentialMLP(), loader, ckpt_path=str(path))
    if first.global_rank == 0:
        (out / "replace.json").write_text(json.dumps({"seen": seen, "resumed_to": again.global_step}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
