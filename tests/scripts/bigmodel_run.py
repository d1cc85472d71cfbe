"""A model built in configure_model() (meta device), trained through the pipeline with sharded checkpoints.

python bigmodel_run.py OUT NAME STAGES STEPS [--resume CKPT] [--full] [--eager | --init-module] [--memory-only]
(model size from BIG_WIDTH and BIG_LAYERS, default 1024 x 4; SGD momentum from BIG_MOMENTUM, default 0.9)
--eager builds the layers in __init__; --init-module does so under trainer.init_module(empty_init=True);
--memory-only writes only the JSON (no tensor files, no checkpoint).

Every rank writes OUT/NAME_rank{r}.json (devices of its parameters, memory, losses, optimizer state sums) and its
own stage's tensors: OUT/NAME_init_rank{r}.pt before training, OUT/NAME_own_rank{r}.pt after. The checkpoint
(sharded unless --full) is OUT/NAME.ckpt.
"""

import json
import os
import resource
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_clapping
from examples.big_model import WideMLP, synthetic_data

WIDTH, LAYERS = int(os.environ.get("BIG_WIDTH", 1024)), int(os.environ.get("BIG_LAYERS", 4))
MOMENTUM = float(os.environ.get("BIG_MOMENTUM", 0.9))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def own_state(module):
    return {k: v for k, v in module.state_dict().items() if not v.is_meta}


def sums(module, optimizer):
    """float64 sums of each materialized parameter and its momentum buffer (by name)."""
    out = {}
    for name, p in module.named_parameters():
        if not p.is_meta:
            out[f"param/{name}"] = float(p.detach().sum(dtype=torch.float64))  # no float64 copy of the tensor
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out[f"momentum/{name}"] = float(buf.sum(dtype=torch.float64))
    return out


class Record(L.Callback):
    def __init__(self, out, name, start_rss, files):
        self.out, self.name, self.start, self.files = out, name, start_rss, files
        self.row = {"losses": []}

    def on_train_start(self, trainer, pl_module):
        if self.files:
            torch.save(own_state(pl_module), self.out / f"{self.name}_init_rank{trainer.global_rank}.pt")
        self.row["start_step"] = trainer.global_step
        self.row["start_sums"] = sums(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.row["losses"].append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_end(self, trainer, pl_module):
        self.row.update(
            rank=trainer.global_rank,
            stage=trainer.strategy.stage,
            devices={n: p.device.type for n, p in pl_module.named_parameters()},
            model_bytes=sum(p.numel() * p.element_size() for p in pl_module.parameters()),
            train_peak_above_start=peak_bytes() - self.start,
            end_sums=sums(pl_module, trainer.optimizers[0]),
            end_step=trainer.global_step,
        )


def main(out: Path, name: str, stages: int, steps: int, resume: str | None, flags: set[str]) -> None:
    start = rss_bytes()
    L.seed_everything(0)
    files = "--memory-only" not in flags
    record = Record(out, name, start, files)
    strategy = lightning_clapping.ClappingStrategy(microbatches=2,
                                                   state_dict_type="full" if "--full" in flags else "sharded")
    trainer = L.Trainer(accelerator="cpu", devices=stages, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record])
    if "--init-module" in flags:
        with trainer.init_module(empty_init=True):
            model = WideMLP(WIDTH, LAYERS, momentum=MOMENTUM, eager=True)
        assert all(p.is_meta for p in model.parameters())
    else:
        model = WideMLP(WIDTH, LAYERS, momentum=MOMENTUM, eager="--eager" in flags)
    trainer.fit(model, synthetic_data(WIDTH), ckpt_path=resume)
    rank = trainer.global_rank
    if files:
        trainer.save_checkpoint(out / f"{name}.ckpt")
        record.row["save_peak_above_start"] = peak_bytes() - start
        torch.save(own_state(model), out / f"{name}_own_rank{rank}.pt")
    (out / f"{name}_rank{rank}.json").write_text(json.dumps(record.row))


if __name__ == "__main__":
    argv = sys.argv[1:]
    flags = {a for a in argv if a in ("--full", "--eager", "--init-module", "--memory-only")}
    argv = [a for a in argv if a not in flags]
    resume = None
    if "--resume" in argv:
        i = argv.index("--resume")
        resume = argv[i + 1]
        del argv[i : i + 2]
    main(Path(argv[0]), argv[1], int(argv[2]), int(argv[3]), resume, flags)
