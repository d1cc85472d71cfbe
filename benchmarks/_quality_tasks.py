"""The tasks of ``benchmarks/quality.py``: data with a held-out validation loader, the model, and its cut.

* ``fashion_mnist``: an MLP 784-512-256-128-10 cut after every hidden layer (the boundaries carry 512, 256 and 128
  features per sample); held-out metric: accuracy on the official 10,000-image test split.
* ``shakespeare``: ``examples/char_lm.py``'s CharTransformer (d=128, 4 heads, 4 blocks, context 128), one block per
  stage (every boundary carries ``[B, 128, 128]``); held-out metric: cross-entropy on windows of the held-out plays
  (Hamlet, Twelfth Night, Julius Caesar), a fixed subset spread evenly over all three.
* ``wordnet_minilm``: fine-tuning a pretrained model. The real all-MiniLM-L6-v2 encoder (Hugging Face transformers,
  6 layers, width 384) with mean pooling and a linear head classifies WordNet noun glosses into 26 supersenses; cut
  before layers 1, 3 and 5 (every boundary carries ``[B, 32, 384]``); held-out metric: accuracy on the seeded
  validation split (10 % of the 82,115 synsets), or an even subset of it.

Every model uses Adam(W) with a fixed learning rate schedule that is the same for every variant of a task.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from datasets import (  # noqa: E402
    FashionMNISTDataModule,
    ShakespeareDataModule,
    WordNetSupersenseDataModule,
    minilm_path,
    missing_reason,
)


def _even_subset(dataset, count: int | None):
    """``count`` samples spread evenly over ``dataset`` (all of it when ``count`` is None or too large)."""
    n = len(dataset)
    if count is None or count >= n:
        return dataset
    idx = np.linspace(0, n - 1, count).round().astype(np.int64)
    return Subset(dataset, np.unique(idx).tolist())


# --------------------------------------------------------------------------------------------------------------------
# Data modules whose validation loader is the held-out set the benchmark reports on
# --------------------------------------------------------------------------------------------------------------------


class HeldOutFashionMNIST(FashionMNISTDataModule):
    """Fashion-MNIST whose ``val_dataloader`` is the official test split (or an even subset of it)."""

    def __init__(self, *args: Any, eval_samples: int | None = None, eval_batch_size: int = 500, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.eval_samples, self.eval_batch_size = eval_samples, eval_batch_size

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_even_subset(self.dataset("test"), self.eval_samples), batch_size=self.eval_batch_size)


class HeldOutShakespeare(ShakespeareDataModule):
    """Shakespeare whose ``val_dataloader`` holds ``eval_samples`` windows spread evenly over the held-out plays."""

    def __init__(self, *args: Any, eval_samples: int | None = None, eval_batch_size: int = 64, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.eval_samples, self.eval_batch_size = eval_samples, eval_batch_size

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_even_subset(self.dataset("val"), self.eval_samples), batch_size=self.eval_batch_size)


class HeldOutWordNet(WordNetSupersenseDataModule):
    """WordNet supersenses whose ``val_dataloader`` holds ``eval_samples`` glosses spread evenly over the validation
    split."""

    def __init__(self, *args: Any, eval_samples: int | None = None, eval_batch_size: int = 256, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.eval_samples, self.eval_batch_size = eval_samples, eval_batch_size

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_even_subset(self.dataset("val"), self.eval_samples), batch_size=self.eval_batch_size)


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------


class MLP(L.LightningModule):
    """784-512-256-128-10 with ReLU; ``net.2``, ``net.4``, ``net.6`` start stages 1, 2, 3."""

    def __init__(self, widths: tuple[int, ...] = (784, 512, 256, 128, 10), lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        logits = self(x)
        # every held-out batch has the same size, so the mean over batches is the exact accuracy
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())
        self.log("val_loss", F.cross_entropy(logits, y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class MiniLMClassifier(L.LightningModule):
    """The pretrained all-MiniLM-L6-v2 encoder, mean-pooled over the real tokens, then a linear head; AdamW."""

    def __init__(self, classes: int = 26, lr: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoModel

        self.encoder = AutoModel.from_pretrained(str(minilm_path()), hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0)
        self.head = nn.Linear(self.encoder.config.hidden_size, classes)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * mask).sum(1) / mask.sum(1))

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["attention_mask"])
        # weighted by batch size: the last held-out batch may be smaller
        n = batch["labels"].numel()
        self.log("val_acc", (logits.argmax(-1) == batch["labels"]).float().mean(), batch_size=n)
        self.log("val_loss", F.cross_entropy(logits, batch["labels"]), batch_size=n)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


#: codec settings of benchmarks/quality.py that change the model: the divisor of the width of the Bottleneck
#: inserted at every cut and its ``init`` (see with_bottlenecks)
BOTTLENECK: dict[str, tuple[int, str]] = {
    **{s: (4, "projection") for s in ("bn4", "bn4 q8", "bn4 moderate")},
    **{s: (8, "projection") for s in ("bn8", "bn8 q8", "bn8 moderate")},
    "bn16 moderate": (16, "projection"),
    **{s: (8, "rescaled") for s in ("bn8 rescaled", "bn8 rescaled q8")},
    "bn16 rescaled q8": (16, "rescaled"),
    # started from the principal directions of what reaches each cut (lightning_clapping.fit_bottlenecks on the
    # first FIT_BATCHES training batches): for a pretrained model, whose later layers expect what the earlier ones
    # produce; bn2 / bn3 / bn4 keep 192 / 128 / 96 of the 384 values per position
    **{s: (3, "pca") for s in ("bn3 pca", "bn3 pca q4")},
    "bn4 pca moderate": (4, "pca"),
    "bn2 pca aggressive": (2, "pca"),
    "bn3 q4": (3, "projection"),  # the control: bn3 pca q4's width and codecs, from the random projection
    # fitted on the real tokens only (fit_bottlenecks' positions: the task's fit_positions), not on the padding
    "bn3 pca-tokens q4": (3, "pca-tokens"),
}
#: training batches that fit_bottlenecks sees for a "pca" start: the first ones of the run's own (seeded) loader
FIT_BATCHES = 8
#: codec settings of benchmarks/quality.py scheduled over training (lightning_clapping.CodecScheduler): the fraction of
#: the steps after which the codecs change, and the (forward, backward) codecs from then on
SCHEDULED: dict[str, tuple[float, tuple[str, str]]] = {
    "q1 then moderate": (0.8, ("q4", "q8")),
    "aggressive then moderate": (0.75, ("q4", "q8")),
}

#: codec settings whose lazy-sampling p changes during the run: the codec setting whose codecs they hold, the
#: fraction of the steps from which the second p holds, and that p
#: (LazySamplingDataModule(dm, p={0: <the run's p>, <that step>: <second p>}))
P_SCHEDULED: dict[str, tuple[str, float, float]] = {
    "randk fresh-q4 then p=0.25": ("randk fresh-q4", 0.5, 0.25),
    "randk fresh-q4 then p=0.5": ("randk fresh-q4", 0.5, 0.5),
    "moderate then p=1": ("moderate", 0.5, 1.0),
}


def _char_transformer():
    from char_lm import CharTransformer  # examples/char_lm.py

    return CharTransformer


#: the benchmark starts that fit_to_data fits, and whether each counts only the task's fit_positions
FITTED = {"pca": False, "pca-tokens": True}


def _start(init: str) -> str:
    """The Bottleneck's own ``init`` for a benchmark start: "pca" and "pca-tokens" begin as the projection, then
    fit_to_data."""
    return "projection" if init in FITTED else init



def fit_to_data(task: "Task", model: L.LightningModule, dm: L.LightningDataModule, init: str) -> dict[str, float]:
    """``fit_bottlenecks`` on the first FIT_BATCHES batches of ``dm``'s training loader (it shuffles with a generator
    of its own, so the run's global random state and batch order stay as they are); for "pca-tokens", on the
    positions ``task.fit_positions`` picks."""
    from lightning_clapping import fit_bottlenecks

    batches = list(itertools.islice(dm.train_dataloader(), FIT_BATCHES))
    positions = task.fit_positions if FITTED[init] else None
    return fit_bottlenecks(model, batches, run=lambda batch: task.fit_forward(model, batch), positions=positions)


def with_bottlenecks(model: L.LightningModule, container: str, cuts: list[int], divisor: int, init: str,
                     width_of: Callable[[nn.Module, int], int]) -> tuple[L.LightningModule, list[str]]:
    """The model with a trainable ``Bottleneck(w, w // divisor, init)`` inserted in ``model.<container>`` before each of
    the elements ``cuts``, and the split points that cut between each bottleneck's halves (``<container>.<i>``).

    The bottlenecks are built after the model, so its own weights are those of the plain model for the same seed;
    ``width_of(container, i)`` is the width of the values entering element ``i``.
    """
    from lightning_clapping import Bottleneck

    old = getattr(model, container)
    items, points = [], []
    for i, module in enumerate(old):
        if i in cuts:
            width = width_of(old, i)
            points.append(f"{container}.{len(items)}")
            items.append(Bottleneck(width, width // divisor, _start(init)))
        items.append(module)
    setattr(model, container, nn.Sequential(*items) if isinstance(old, nn.Sequential) else nn.ModuleList(items))
    return model, points


def blocks_bottlenecks(model: L.LightningModule, divisor: int, init: str) -> tuple[L.LightningModule, list[str]]:
    """A transformer's ``blocks`` with a Bottleneck before blocks 1, 2 and 3 (the residual stream, as wide as each
    block's first LayerNorm): the cuts of every character LM and the vision transformer of the benchmarks."""
    return with_bottlenecks(model, "blocks", [1, 2, 3], divisor, init,
                            lambda blocks, i: blocks[i].ln1.normalized_shape[0])


def with_bottlenecks_after(model: L.LightningModule, container: str, cuts: list[int], divisor: int, init: str,
                           width: int) -> tuple[L.LightningModule, list[str]]:
    """For a model that calls the blocks of ``model.<container>`` in a loop (a Hugging Face encoder): each block just
    before one of ``cuts`` wrapped in ``BottleneckAfter(block, width, width // divisor, init)``, and the split points
    naming those bottlenecks. The wrappers are built after the model, so its own weights are the plain model's."""
    from lightning_clapping import BottleneckAfter

    blocks, points = model.get_submodule(container), []
    for i in cuts:
        blocks[i - 1] = BottleneckAfter(blocks[i - 1], width, width // divisor, _start(init))
        points.append(f"{container}.{i - 1}.bottleneck")
    return model, points


# --------------------------------------------------------------------------------------------------------------------
# Task descriptions
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Task:
    name: str
    title: str
    metric: str  # the key logged by validation_step
    metric_label: str
    higher_is_better: bool
    source: str  # the data source name for examples/datasets.missing_reason
    split_points: list[str]
    microbatches: int
    batch_size: int
    make_data: Callable[..., L.LightningDataModule]
    make_model: Callable[[L.LightningDataModule], L.LightningModule]
    #: (model, divisor, init) -> (the model with a Bottleneck of width // divisor at every cut, its split points)
    add_bottlenecks: Callable[[L.LightningModule, int, str], tuple[L.LightningModule, list[str]]]
    gradient_clip_val: float | None = None
    #: (model, batch) -> the model's forward on one training batch (for fit_to_data)
    fit_forward: Callable[[L.LightningModule, Any], Any] = lambda model, batch: model(batch[0])
    #: batch -> the positions a "pca-tokens" fit counts (fit_bottlenecks' positions), where the task has padding
    fit_positions: Callable[[Any], Any] | None = None

    def missing(self) -> str | None:
        return missing_reason(self.source)


def _fashion_data(seed: int, limit: int | None, eval_samples: int | None, batch_size: int):
    return HeldOutFashionMNIST(batch_size=batch_size, seed=seed, limit=limit, eval_samples=eval_samples)


def _shakespeare_data(seed: int, limit: int | None, eval_samples: int | None, batch_size: int):
    return HeldOutShakespeare(batch_size=batch_size, seed=seed, limit=limit, eval_samples=eval_samples,
                              block_size=128)


def _wordnet_data(seed: int, limit: int | None, eval_samples: int | None, batch_size: int):
    return HeldOutWordNet(batch_size=batch_size, seed=seed, limit=limit, eval_samples=eval_samples, max_length=32)


TASKS: dict[str, Task] = {
    "fashion_mnist": Task(
        name="fashion_mnist",
        title="Fashion-MNIST, MLP 784-512-256-128-10, 4 stages",
        metric="val_acc",
        metric_label="test accuracy (official test split)",
        higher_is_better=True,
        source="fashion_mnist",
        split_points=["net.2", "net.4", "net.6"],
        microbatches=4,
        batch_size=128,
        make_data=_fashion_data,
        make_model=lambda dm: MLP(),
        # before net.2, net.4, net.6: the widths 512, 256 and 128 after the ReLUs
        add_bottlenecks=lambda model, divisor, init: with_bottlenecks(model, "net", [2, 4, 6], divisor, init,
                                                                      lambda net, i: net[i].in_features),
    ),
    "shakespeare": Task(
        name="shakespeare",
        title="Shakespeare char-LM, transformer d=128 x 4 blocks, context 128, 4 stages",
        metric="val_loss",
        metric_label="validation loss (held-out plays)",
        higher_is_better=False,
        source="shakespeare",
        split_points=["blocks.1", "blocks.2", "blocks.3"],
        microbatches=8,
        batch_size=32,
        make_data=_shakespeare_data,
        make_model=lambda dm: _char_transformer()(dm.vocab_size, block_size=128, d=128, heads=4, layers=4,
                                                  dropout=0.0, lr=1e-3, warmup=20),
        add_bottlenecks=blocks_bottlenecks,  # the residual stream, width 128
        gradient_clip_val=1.0,
    ),
    "wordnet_minilm": Task(
        name="wordnet_minilm",
        title="WordNet supersenses, pretrained MiniLM-L6 fine-tuned (width 384, 32 tokens), 4 stages",
        metric="val_acc",
        metric_label="accuracy (held-out validation split)",
        higher_is_better=True,
        source="wordnet",
        split_points=["encoder.encoder.layer.1", "encoder.encoder.layer.3", "encoder.encoder.layer.5"],
        microbatches=4,
        batch_size=32,
        make_data=_wordnet_data,
        make_model=lambda dm: MiniLMClassifier(classes=dm.num_classes),
        # after layers 0, 2 and 4: the residual stream, width 384
        add_bottlenecks=lambda model, divisor, init: with_bottlenecks_after(
            model, "encoder.encoder.layer", [1, 3, 5], divisor, init, model.encoder.config.hidden_size),
        fit_forward=lambda model, batch: model(batch["input_ids"], batch["attention_mask"]),
        fit_positions=lambda batch: batch["attention_mask"].bool(),  # the real tokens, about half of 32
    ),
}
