"""Short compressed runs through 3 stages; each rank saves its error-feedback buffers and the logged numbers.

python feedback_run.py OUT NAME=JSON [NAME=JSON ...]
JSON keys: variant, fwd, bwd, p (lazy sampling), lr, steps, warm_start, lazy, dropout
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data


class DropoutMLP(SequentialMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        # stage 0 (net.0, net.1) ends with dropout, so the activation it sends carries the mask
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 32), nn.Dropout(0.3),
                                 nn.Tanh(), nn.Linear(32, 4))


class SaveState(L.Callback):
    def __init__(self, out, name):
        self.out, self.name, self.sent, self.step = out, name, [], 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sent = []
        chan = trainer.strategy.executor.fwd_out
        if chan is not None and not hasattr(chan, "_orig_send_ops"):
            chan._orig_send_ops = chan.send_ops  # the packed message, which the ops it returns hand to torch
            sink = self

            def send_ops(slot, msg, mode=None):
                sink.sent.append(msg.detach().clone())
                return chan._orig_send_ops(slot, msg, mode)

            chan.send_ops = send_ops

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # the first message of the step as it was handed to torch.distributed (stage 0 only has fwd_out to stage 1)
        if self.sent and trainer.strategy.stage == 0:
            torch.save(self.sent, self.out / f"{self.name}_sent_step{self.step}.pt")
        self.step += 1

    def on_train_end(self, trainer, pl_module):
        st = trainer.strategy
        torch.save({"stage": st.stage, "feedback": st.executor.feedback_state(),
                    "weights": {k: v.clone() for k, v in pl_module.state_dict().items() if v.device.type != "meta"}},
                   self.out / f"{self.name}_rank{trainer.global_rank}.pt")


def run(out, name, cfg):
    torch.manual_seed(0)
    model = (DropoutMLP if cfg.get("dropout") else SequentialMLP)(lr=cfg.get("lr", 0.05), optimizer="sgd")
    x, y = classification_data(n=cfg.get("n", 64), seed=1)
    data = lightning_clapping.LazySamplingDataModule(
        DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)),
        p=cfg.get("p", 0.5), seed=3)
    def codec(value):  # {"1": "q4"} in JSON: per-boundary codecs
        return {int(k): v for k, v in value.items()} if isinstance(value, dict) else value

    strategy = lightning_clapping.ClappingStrategy(
        split_points=["net.2", "net.4"], microbatches=4, variant=cfg["variant"],
        forward_codec=codec(cfg.get("fwd", "q4")), backward_codec=codec(cfg.get("bwd", "q8")),
        fresh_codec=cfg.get("fresh"), warm_start=cfg.get("warm_start", True), lazy_messages=cfg.get("lazy"))
    trainer = L.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_steps=cfg.get("steps", 12),
                        logger=CSVLogger(out, name=name, version=0), log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[SaveState(out, name)])
    trainer.fit(model, datamodule=data)
    if trainer.global_rank == 0:
        (out / f"{name}_progress_bar.json").write_text(json.dumps(sorted(trainer.progress_bar_metrics)))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for arg in sys.argv[2:]:
        name, cfg = arg.split("=", 1)
        run(out, name, json.loads(cfg))
