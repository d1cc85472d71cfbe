"""One replica group of a fault-tolerant run (2 stages of a small MLP), started by torchrun, one torchrun per group.

    torchrun --nproc-per-node 2 ... ft_run.py OUT MAX_STEPS
    environment: TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS (read by fault_tolerance="torchft"),
                 FT_TIMEOUT (seconds, the groups' collective timeout), FT_LAZY=1 (lazy sampling, p=0.5),
                 FT_DILOCO=H (replica_sync=DiLoCo(inner_steps=H): local steps, an outer step every H)

Every rank appends one JSON line per training step to OUT/group<g>_rank<r>.jsonl: wall time, its pid, the global
step, whether torchft committed the step (with DiLoCo: the last outer step), how many groups took part in it, how many
votes were lost so far, how many heals this process did, the time this process started, and the sum of the batch's
inputs (which samples it trained on). After the run, rank 0 of each group saves the whole model to OUT/group<g>_final.pt.

Pacing: a group that trains alone (its peer is down) sleeps SLOW seconds per step, so that the survivors are still
training when the lost group comes back however slowly its processes start here; with peers it runs at full speed.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

STARTED = time.time()

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_clapping  # noqa: E402
from lightning_clapping.fault_tolerance import replica_group  # noqa: E402
from _models import SequentialMLP, classification_data  # noqa: E402

SLOW = 0.25


class Progress(L.Callback):
    def __init__(self, out: Path, group: int) -> None:
        self.out, self.group = out, group

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        votes = replica_group(trainer).votes
        _, _, committed, participants = votes[-1] if votes else (0, 0, True, 0)
        record = {"t": time.time(), "pid": os.getpid(), "step": trainer.global_step, "committed": committed,
                  "participants": participants, "heals": replica_group(trainer).heals, "started": STARTED,
                  "votes": len(votes), "votes_lost": sum(not v[2] for v in votes),
                  "epoch": trainer.current_epoch, "batch_idx": batch_idx, "xsum": float(batch[0].double().sum())}
        with open(self.out / f"group{self.group}_rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if participants < 2:
            time.sleep(SLOW)


def main() -> None:
    out, max_steps = Path(sys.argv[1]), int(sys.argv[2])
    group = int(os.environ["REPLICA_GROUP_ID"])
    torch.manual_seed(100 + group)  # the groups start from different weights: init_sync must make them equal
    model = SequentialMLP(lr=0.05)
    x, y = classification_data(n=256, seed=1)
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))
    if os.environ.get("FT_LAZY") == "1":
        data = lightning_clapping.LazySamplingDataModule(data, p=0.5, seed=3)
    ft = lightning_clapping.FaultTolerance(timeout=timedelta(seconds=float(os.environ.get("FT_TIMEOUT", "20"))))
    sync = lightning_clapping.DiLoCo(inner_steps=int(os.environ["FT_DILOCO"])) if os.environ.get("FT_DILOCO") else None
    strategy = lightning_clapping.ClappingStrategy(split_points=["net.4"], microbatches=2, fault_tolerance=ft,
                                                   log_bytes=False, replica_sync=sync)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Progress(out, group)])
    if isinstance(data, DataLoader):
        trainer.fit(model, train_dataloaders=data)
    else:
        trainer.fit(model, datamodule=data)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"group{group}_final.pt")


if __name__ == "__main__":
    main()
