"""A fine-tune of the real pretrained MiniLM encoder on 2 stages, its weights read per stage: the LightningModule
builds ``BertModel`` from the checkpoint's config in ``configure_model()`` (on the meta device), and
``ClappingStrategy(pretrained={"encoder": folder})`` has each stage read its own tensors from ``model.safetensors``.

python pretrained_run.py OUT

``safetensors.safe_open`` is watched: every rank writes OUT/read_rank{r}.json (the files it opened, the tensors it
read) and OUT/own_rank{r}.pt (its tensors at the start of training).
"""

import json
import sys
from pathlib import Path

import lightning as L
import safetensors
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lightning_clapping
from _models import minilm_path, text_data

READ: dict[str, list[str]] = {"opened": [], "tensors": []}
_safe_open = safetensors.safe_open


class WatchedFile:
    """safetensors' file handle, recording what is read through it."""

    def __init__(self, path, framework, device="cpu"):
        READ["opened"].append(Path(path).name)
        self.handle = _safe_open(path, framework=framework, device=device)

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_slice(self, key):
        return self.handle.get_slice(key)

    def get_tensor(self, key):
        READ["tensors"].append(key)
        return self.handle.get_tensor(key)


safetensors.safe_open = WatchedFile


class MiniLMFineTune(L.LightningModule):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.classes = classes
        self.encoder: nn.Module | None = None
        self.head: nn.Module | None = None

    def configure_model(self) -> None:
        if self.encoder is not None:
            return
        from transformers import BertConfig, BertModel

        config = BertConfig.from_pretrained(minilm_path(), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.encoder = BertModel(config)
        self.head = nn.Linear(config.hidden_size, self.classes)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, 0])

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SaveOwn(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        named = dict(pl_module.named_parameters()) | dict(pl_module.named_buffers())
        torch.save({k: v.detach().clone() for k, v in named.items() if not v.is_meta},
                   self.out / f"own_rank{trainer.global_rank}.pt")


def main(out: Path) -> None:
    L.seed_everything(0)
    batch = text_data(n=8)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(8)]
    strategy = lightning_clapping.ClappingStrategy(split_points=["encoder.encoder.layer.3"], microbatches=2,
                                                   pretrained={"encoder": str(minilm_path())})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SaveOwn(out)])
    trainer.fit(MiniLMFineTune(), DataLoader(rows, batch_size=8))
    (out / f"read_rank{trainer.global_rank}.json").write_text(json.dumps(READ))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
