"""Precision and activation-checkpointing runs, through ClappingStrategy (2 stages) or on one device.

python precision_run.py MODE OUT CONFIG[,CONFIG...]     MODE: "pipe" or "single"

Each run saves ``{config}_{mode}_rank{r}.json`` (losses, loss scales, dtypes seen) and, on rank 0,
``{config}_{mode}.pt`` (final weights) and ``{config}_{mode}_feedback_rank{r}.pt`` (error-feedback buffers).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping
from _models import SequentialMLP, classification_data


class DropBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(F.gelu(self.lin(x)))


class DropoutNet(SequentialMLP):
    """Blocks with dropout, cut in the middle of the block list (the second stage starts with a block)."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.1)
        self.net = nn.Sequential(nn.Linear(16, 32), *[DropBlock(32) for _ in range(4)], nn.Linear(32, 4))


class ReluNet(SequentialMLP):
    """Large inputs, small first-layer weights: the first stage's weight gradients are far larger than the second's,
    so a loss scale can overflow the first stage's fp16 gradients only."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.05)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32),
                                 nn.ReLU(), nn.Linear(32, 4))
        with torch.no_grad():
            self.net[0].weight.mul_(0.01)


# name: (model class, input scale, split points, strategy kwargs, trainer kwargs)
CONFIGS = {
    "bf16mixed": (SequentialMLP, 1.0, ["net.4"], {}, {"precision": "bf16-mixed"}),
    "bf16true": (SequentialMLP, 1.0, ["net.4"], {}, {"precision": "bf16-true"}),
    "bf16true_fc": (SequentialMLP, 1.0, ["net.4"], {"variant": "clapping-fc", "forward_codec": "q8",
                                                    "backward_codec": "q8"}, {"precision": "bf16-true"}),
    "fp16": (ReluNet, 100.0, ["net.4"], {"microbatches": 1}, {"fp16": True}),
    "dropout": (DropoutNet, 1.0, ["net.3"], {}, {}),
    "dropout_ckpt": (DropoutNet, 1.0, ["net.3"], {"activation_checkpointing": True}, {}),
}


class Probe(L.Callback):
    def __init__(self) -> None:
        self.losses, self.scales, self.info = [], [], {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(scaler.get_scale())

    def on_train_end(self, trainer, pl_module) -> None:
        self.info["param_dtypes"] = sorted({str(p.dtype) for p in pl_module.parameters() if p.device.type != "meta"})
        executor = getattr(trainer.strategy, "executor", None)
        if executor is not None:
            self.info["sent_dtypes"] = {name: [str(spec[1]) for spec in specs]
                                        for name, specs in executor.sent_specs.items()}
            self.info["feedback"] = executor.feedback_state()
            self.info["checkpointed"] = trainer.strategy.runner.checkpointed
            totals = trainer.strategy.byte_totals  # every stage's messages (headers and step results included)
            control = totals["control_bytes"]
            self.info["wire_ratio"] = (totals["bytes"] - control) / (totals["raw_bytes"] - control)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            shared = getattr(scaler.__dict__.get("unscale_"), "shared_loss_scale", None) if scaler else None
            if shared is not None:
                self.info["skipped_for_others"] = shared.skipped_for_others


def run(mode: str, out: Path, name: str) -> None:
    cls, input_scale, splits, strategy_kw, trainer_kw = CONFIGS[name]
    torch.manual_seed(0)
    model = cls()
    x, y = classification_data(n=64, seed=1)
    loader = DataLoader(TensorDataset(x * input_scale, y), batch_size=16)
    trainer_kw = dict(trainer_kw)
    if trainer_kw.pop("fp16", False):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1)
        trainer_kw["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    if mode == "pipe":
        strategy = lightning_clapping.ClappingStrategy(split_points=splits, **{"microbatches": 2, **strategy_kw})
        devices = len(splits) + 1
    else:
        strategy, devices = "auto", 1
    probe = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=3, logger=False,
                        callbacks=[probe], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, **trainer_kw)
    trainer.fit(model, loader)
    rank = trainer.global_rank
    feedback = probe.info.pop("feedback", None)
    if feedback and any(feedback.values()):
        torch.save(feedback, out / f"{name}_{mode}_feedback_rank{rank}.pt")
    result = {"losses": probe.losses, "scales": probe.scales, **probe.info}
    (out / f"{name}_{mode}_rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        torch.save({k: v.float() for k, v in model.state_dict().items()}, out / f"{name}_{mode}.pt")


if __name__ == "__main__":
    mode, out, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    for name in names:
        run(mode, out, name)
