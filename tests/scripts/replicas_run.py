"""Data parallel x pipeline through Lightning, with its defaults (distributed sampler, checkpointing, a logger).

python replicas_run.py MODE OUT CONFIG[,CONFIG...]
    MODE "dp": 2 replicas x 2 stages (4 processes), 8 samples per replica and step
    MODE "single": one process, 16 samples per step: the union of the replicas' batches (the replicas' sampler is
    Lightning's DistributedSampler, which shuffles training data; one replica of it gives the same permutation)

Every rank writes OUT/<config>_<mode>_rank<r>.json; rank 0 also the final weights.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data

PER_REPLICA = 8


class SyncedMLP(SequentialMLP):
    """Logs its loss averaged over the replicas (``sync_dist=True``) and what every rank trained on."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x[:, 0].tolist())
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


CONFIGS = {
    # name: (trainer kwargs, strategy kwargs, extra)
    "plain": ({"max_steps": 3}, {}, {}),
    "clip_acc": ({"max_steps": 3, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05}, {}, {}),
    "fc_full": ({"max_steps": 6}, {"variant": "clapping-fc"}, {"lazy": True}),
    "fc_first": ({"max_steps": 3}, {"variant": "clapping-fc"}, {"lazy": True}),
    "fc_rest": ({"max_steps": 6}, {"variant": "clapping-fc"}, {"lazy": True, "resume": "fc_first"}),
    "sh_first": ({"max_steps": 3}, {"variant": "clapping-fc", "state_dict_type": "sharded"}, {"lazy": True}),
    "sh_rest": ({"max_steps": 6}, {"variant": "clapping-fc", "state_dict_type": "sharded"},
                {"lazy": True, "resume": "sh_first"}),
}


def run(mode: str, out: Path, name: str) -> None:
    trainer_kw, strategy_kw, extra = CONFIGS[name]
    torch.manual_seed(0)
    model = SyncedMLP(lr=0.1)
    x, y = classification_data(n=96, seed=1)
    if mode == "dp":
        strategy = lightning_clapping.ClappingStrategy(split_points=["net.4"], microbatches=2, **strategy_kw)
        devices, batch = 4, PER_REPLICA
    else:
        strategy, devices, batch = "auto", 1, 2 * PER_REPLICA
    dataset = TensorDataset(x, y)
    if mode == "dp":  # Lightning's default use_distributed_sampler=True shards (and shuffles) it per replica
        data = DataLoader(dataset, batch_size=batch)
    else:  # the same permutation as the replicas' samplers: each batch is the union of the replicas' batches
        data = DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, 1, 0, shuffle=True, seed=0))
    if extra.get("lazy"):
        data = lightning_clapping.LazySamplingDataModule(data, p=0.5, seed=3)
    losses = Losses()
    ckpt = ModelCheckpoint(dirpath=out / f"ckpt_{name}", save_last=True, every_n_train_steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=[losses, ckpt],
                        logger=CSVLogger(out, name=f"csv_{name}_{mode}"), enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1, deterministic=True, **trainer_kw)
    resume = extra.get("resume")
    trainer.fit(model, data, ckpt_path=str(out / f"ckpt_{resume}" / "last.ckpt") if resume else None)
    rank = trainer.global_rank
    result = {"losses": losses.losses, "seen": model.seen, "global_step": trainer.global_step,
              "world_size": trainer.world_size, "bytes": trainer.strategy.byte_totals.get("bytes")
              if mode == "dp" else None, "totals": trainer.strategy.byte_totals if mode == "dp" else None}
    if rank == 0 and strategy_kw.get("state_dict_type") != "sharded":  # a sharded run keeps only its stage
        torch.save(model.state_dict(), out / f"weights_{name}_{mode}.pt")
    (out / f"{name}_{mode}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    mode, out, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    for name in names:
        run(mode, out, name)
