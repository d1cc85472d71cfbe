"""Lightning end-to-end runs, with ClappingStrategy or on a single device, saving what the tests compare.

python fit_run.py MODE OUT CONFIG[,CONFIG...]     MODE: "pipe" (3 stages) or "single"
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import Recorder, SequentialMLP, classification_data


class MetricMLP(SequentialMLP):
    """Logs torchmetrics Metric objects (state on the last stage; compute() at epoch end)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return torch.nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y))


class SyncDistMLP(SequentialMLP):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)


CONFIGS = {
    # name: (trainer kwargs, model kwargs, extra)
    "base": ({"max_epochs": 3}, {"optimizer": "adam", "lr": 0.01}, {}),
    "accumulate": ({"max_epochs": 2, "accumulate_grad_batches": 2}, {"optimizer": "sgd", "lr": 0.1}, {}),
    "clip": ({"max_epochs": 2, "gradient_clip_val": 0.05}, {"optimizer": "sgd", "lr": 0.5}, {}),
    "earlystop": ({"max_epochs": 20}, {"optimizer": "adam", "lr": 0.01}, {"early": True}),
    "syncdist": ({"max_epochs": 1}, {"optimizer": "adam", "lr": 0.01}, {"sync": True}),
    "metrics": ({"max_epochs": 2}, {"optimizer": "adam", "lr": 0.01}, {"metrics": True}),
    "resume_full": ({"max_epochs": 4}, {"optimizer": "adam", "lr": 0.01}, {}),
    "resume_first": ({"max_epochs": 2}, {"optimizer": "adam", "lr": 0.01}, {}),
    "resume_rest": ({"max_epochs": 4}, {"optimizer": "adam", "lr": 0.01}, {"resume": "resume_first"}),
}


def loaders():
    x, y = classification_data(n=70, seed=1)
    xv, yv = classification_data(n=30, seed=2)
    train = DataLoader(TensorDataset(x, y), batch_size=16)  # 70 = 4 x 16 + 6: a smaller last batch
    val = DataLoader(TensorDataset(xv, yv), batch_size=16)
    return train, val


def run(mode, out, name):
    trainer_kw, model_kw, extra = CONFIGS[name]
    torch.manual_seed(0)
    cls = SyncDistMLP if extra.get("sync") else MetricMLP if extra.get("metrics") else SequentialMLP
    model = cls(**model_kw)
    rec = Recorder()
    ckpt = ModelCheckpoint(dirpath=out / f"ckpt_{name}_{mode}", monitor="val_loss", save_top_k=2,
                           filename="{epoch}-{val_loss:.4f}", save_last=True)
    callbacks = [rec, ckpt]
    if extra.get("early"):
        callbacks.append(EarlyStopping(monitor="val_loss", min_delta=0.5, patience=1))
    if mode == "pipe":
        strategy, devices = lightning_clapping.ClappingStrategy(split_points=["net.2", "net.4"], microbatches=4), 3
    else:
        strategy, devices = "auto", 1
    loggers = [CSVLogger(out, name=f"csv_{name}_{mode}"), TensorBoardLogger(out, name=f"tb_{name}_{mode}")]
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=loggers, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, deterministic=True, log_every_n_steps=1, **trainer_kw)
    train, val = loaders()
    resume = extra.get("resume")
    ckpt_path = str(out / f"ckpt_{resume}_{mode}" / "last.ckpt") if resume else None
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    result = {
        "losses": rec.losses,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "epochs_run": trainer.current_epoch,
        "global_step": trainer.global_step,
        "best_model_path": ckpt.best_model_path,
        "best_model_score": float(ckpt.best_model_score) if ckpt.best_model_score is not None else None,
        "csv": str(Path(loggers[0].log_dir) / "metrics.csv"),
        "tb": str(loggers[1].log_dir),
    }
    if name == "base":
        test = trainer.test(model, val, verbose=False)
        preds = trainer.predict(model, val)
        result["test"] = test
        if trainer.global_rank == 0:
            torch.save(torch.cat(preds), out / f"preds_{name}_{mode}.pt")
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), out / f"weights_{name}_{mode}.pt")
    (out / f"{name}_{mode}_rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    mode, out, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    for name in names:
        run(mode, out, name)
