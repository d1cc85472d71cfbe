"""The real pretrained MiniLM encoder fine-tuned in training mode (``self.encoder.train()``, as users enable dropout)
on 2 stages, with a validation: the stage without the embeddings switches the model to eval mode there.

python hf_train_mode_run.py OUT     writes OUT/rank{r}.json (validation accuracy, the model's kernel device after fit)
"""

import json
import sys
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

import lightning_clapping
from _models import MiniLMClassifier, text_data


class TrainModeMiniLM(MiniLMClassifier):
    def __init__(self) -> None:
        super().__init__(layers=3)
        self.encoder.train()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    data = text_data(n=16)
    rows = [{k: v[i] for k, v in data.items()} for i in range(16)]
    model = TrainModeMiniLM()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, val_check_interval=2, limit_val_batches=1,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        strategy=lightning_clapping.ClappingStrategy(split_points=["encoder.encoder.layer.1"]))
    trainer.fit(model, DataLoader(rows, batch_size=8), DataLoader(rows, batch_size=8))
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "encoder_training": model.encoder.training,
        "kernel_device_left": "_kernels_device" in model.encoder.__dict__,
    }))
