"""2 replicas x 2 stages with each replica_sync mode, through Lightning (its distributed sampler).

python replica_sync_run.py OUT CONFIG[,CONFIG...]

Every rank writes OUT/<config>_rank<r>.json (its stage's trained tensors, the byte totals) and rank 0 the whole
model's final weights OUT/weights_<config>.pt.
"""

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from lightning_clapping import LAG, DiLoCo
from _models import SequentialMLP, classification_data

CONFIGS = {  # name: (replica_sync, max_steps, optimizer)
    "every": ("every-step", 6, "sgd"),
    "lag0": (LAG(threshold=0.0), 6, "sgd"),
    "lag": (LAG(), 6, "sgd"),
    "lag_avg0": (LAG(threshold=0.0, reference="average"), 6, "sgd"),
    "diloco1": (DiLoCo(inner_steps=1, outer_lr=1.0, momentum=0.0), 6, "sgd"),
    "diloco3": (DiLoCo(inner_steps=3), 6, "adam"),
    "diloco4_end": (DiLoCo(inner_steps=4), 6, "sgd"),  # the fit ends 2 steps after its last sync
    "diloco3_q8": (DiLoCo(inner_steps=3, codec="q8"), 6, "sgd"),
    "diloco2_frag": (DiLoCo(inner_steps=2, fragments=2), 6, "sgd"),
    # resumed between syncs: 4 steps and a checkpoint, then steps 5 and 6 from it (replica 1's own parameters and
    # Adam state, the anchor and the outer momentum come back), against diloco3 (6 steps straight)
    "diloco3_first": (DiLoCo(inner_steps=3), 4, "adam"),
    "diloco3_rest": (DiLoCo(inner_steps=3), 6, "adam"),
    "lag_first": (LAG(), 4, "sgd"),
    "lag_rest": (LAG(), 6, "sgd"),
    "diloco3_q8_first": (DiLoCo(inner_steps=3, codec="q8"), 4, "sgd"),  # sharded, with residuals
    "diloco3_q8_rest": (DiLoCo(inner_steps=3, codec="q8"), 6, "sgd"),
    # streaming overlap: the sync after step 4 lands after step 6, with steps 5 and 6 kept on top of the new anchor;
    # _first saves at step 4 with that sync in flight, _rest resumes it
    "diloco4": (DiLoCo(inner_steps=4), 6, "adam"),
    "diloco4_ov2": (DiLoCo(inner_steps=4, overlap=2), 6, "adam"),
    "diloco4_ov2_first": (DiLoCo(inner_steps=4, overlap=2), 4, "adam"),
    "diloco4_ov2_rest": (DiLoCo(inner_steps=4, overlap=2), 6, "adam"),
    "every_rest": ("every-step", 6, "adam"),  # from diloco3_first's checkpoint: its sync state is not used
    "apart": ("every-step", 2, "sgd"),  # each process seeds its model differently: refused at the first step
}
SHARDED = {"diloco3_q8_first", "diloco3_q8_rest"}


def run(out: Path, name: str) -> None:
    sync, steps, optimizer = CONFIGS[name]
    torch.manual_seed(int(os.environ.get("LOCAL_RANK", "0")) if name == "apart" else 0)
    model = SequentialMLP(lr=0.1, optimizer=optimizer)
    x, y = classification_data(n=32, seed=1)  # 2 batches per replica and epoch: step 4 ends an epoch
    strategy = lightning_clapping.ClappingStrategy(split_points=["net.4"], microbatches=2, replica_sync=sync,
                                                   state_dict_type="sharded" if name in SHARDED else "full")
    first = name.endswith("_first")
    callbacks = [ModelCheckpoint(dirpath=out / f"ckpt_{name}", save_last=True, every_n_train_steps=4)] if first else []
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=first, callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    source = "diloco3_first" if name == "every_rest" else name.replace("_rest", "_first")
    resume = out / f"ckpt_{source}" / "last.ckpt" if name.endswith("_rest") else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8), ckpt_path=resume)
    own = {k: v.tolist() for k, v in model.state_dict().items() if not v.is_meta}
    result = {"own": own, "stage": trainer.strategy.stage, "replica": trainer.strategy.replica,
              "totals": trainer.strategy.byte_totals, "warnings": [str(w.message) for w in caught]}
    if trainer.global_rank == 0 and name not in SHARDED:  # a sharded run keeps only its stage
        torch.save(model.state_dict(), out / f"weights_{name}.pt")
    (out / f"{name}_rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    for name in names:
        run(out, name)
