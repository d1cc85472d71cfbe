"""Two more from-scratch quality tasks for ``quality.py``: a text corpus and model width the frontier was not tuned
on, and a vision transformer.

* ``wordnet_glosses``: a character-level LM on the glosses (definitions and examples) of WordNet 3.0, all four parts
  of speech: 117,659 glosses, about 9 M characters, 92 characters in the vocabulary. The held-out split is fixed by
  the data: gloss ``i`` (file order) is validation when ``i % 20 == 0``, test when ``i % 20 == 10``. The model is
  ``examples/char_lm.py``'s transformer at width 96 with dropout 0.1 (4 blocks, 4 heads, context 128), cut before
  blocks 1, 2 and 3 (the residual stream, width 96). Needs ``apt-get install wordnet-base``.
* ``fashion_vit``: Fashion-MNIST (the official test split held out) with a small vision transformer: 4x4 patches (49
  tokens), width 64, 4 pre-norm blocks with full attention, mean pooling; cut before blocks 1, 2 and 3 (the tokens,
  ``[B, 49, 64]``). The same data as ``fashion_mnist`` with another kind of model: what crosses a cut is a set of
  image tokens, not an MLP's features. Needs ``apt-get install dataset-fashion-mnist``.

* ``shakespeare_d256`` (opt-in: run only when named in ``--tasks``): the Shakespeare task at twice the width (d=256,
  4 heads of 64, 4 blocks, the same data, cuts, optimizer and lengths): does the bottleneck's cost in capacity fall
  when the same fraction of a wider stream crosses a cut?

``register`` adds the tasks, their per-mode settings and their time estimates to ``quality.py``'s tables.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from _quality_tasks import TASKS, MLP, Task, _char_transformer, _even_subset, _fashion_data, blocks_bottlenecks
from datasets import WORDNET_DIRS, CharWindowDataset, _SplitDataModule, find_wordnet_noun_file

#: WordNet's data files, in the order their glosses are concatenated
WORDNET_POS: tuple[str, ...] = ("noun", "verb", "adj", "adv")
HOLDOUT_PERIOD = 20


def read_glosses() -> list[str]:
    """Every synset's gloss, nouns, verbs, adjectives, adverbs (file order)."""
    folder = find_wordnet_noun_file().parent
    glosses = []
    for pos in WORDNET_POS:
        path = folder / f"data.{pos}"
        if not path.is_file():
            raise FileNotFoundError(f"WordNet's {path.name} not found in {folder} (searched {WORDNET_DIRS}). "
                                    "Install it with `apt-get install wordnet-base`.")
        with open(path, encoding="utf-8", errors="replace") as fh:
            glosses += [line.partition(" | ")[2].strip() for line in fh if not line.startswith("  ")]
    return glosses


class GlossChars(_SplitDataModule):
    """Character windows (``block_size + 1`` characters, not overlapping, possibly spanning glosses) of the gloss
    text, each gloss followed by a newline; ``val_dataloader`` holds ``eval_samples`` windows spread evenly over the
    validation glosses."""

    def __init__(self, batch_size: int = 32, seed: int = 0, limit: int | None = None, block_size: int = 128,
                 eval_samples: int | None = None, eval_batch_size: int = 64, return_index: bool = False) -> None:
        super().__init__(batch_size, seed, 0, limit, return_index, False)
        self.block_size, self.eval_samples, self.eval_batch_size = block_size, eval_samples, eval_batch_size
        self.glosses = read_glosses()
        self.vocab = sorted(set("".join(self.glosses)) | {"\n"})

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _build(self) -> dict[str, Any]:
        lut = np.zeros(256, dtype=np.uint8)
        for i, ch in enumerate(self.vocab):
            lut[ord(ch)] = i
        which = np.arange(len(self.glosses)) % HOLDOUT_PERIOD
        members = {"train": (which != 0) & (which != HOLDOUT_PERIOD // 2), "val": which == 0,
                   "test": which == HOLDOUT_PERIOD // 2}
        span, out = self.block_size + 1, {}
        for split, keep in members.items():
            text = "".join(g + "\n" for g, k in zip(self.glosses, keep) if k)
            codes = lut[np.frombuffer(text.encode("latin-1", errors="replace"), dtype=np.uint8)]
            starts = self._split_indices[split] = self._limited(span * np.arange(len(codes) // span, dtype=np.int64))
            out[split] = CharWindowDataset(torch.from_numpy(codes.astype(np.int64)), torch.from_numpy(starts),
                                           self.block_size, self.return_index)
        return out

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_even_subset(self.dataset("val"), self.eval_samples), batch_size=self.eval_batch_size)


class ViTBlock(nn.Module):
    """Pre-norm transformer block with full (not causal) attention over the image tokens."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class FashionViT(L.LightningModule):
    """28x28 images as 49 patches of 4x4 pixels, a linear patch embedding plus a learned position embedding, 4
    blocks, mean pooling and a linear head; ``MLP``'s steps (cross-entropy, val_acc and val_loss) with AdamW."""

    training_step = MLP.training_step
    validation_step = MLP.validation_step

    def __init__(self, d: int = 64, heads: int = 4, layers: int = 4, patch: int = 4, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.patch, tokens = patch, (28 // patch) ** 2
        self.embed = nn.Linear(patch * patch, d)
        self.pos = nn.Parameter(torch.randn(1, tokens, d) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(d, heads) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 10)

    def forward(self, x):
        p = self.patch
        img = x.reshape(-1, 28 // p, p, 28 // p, p).permute(0, 1, 3, 2, 4).reshape(x.shape[0], -1, p * p)
        h = self.blocks(self.embed(img) + self.pos)
        return self.head(self.norm(h).mean(1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class _GlossTask(Task):
    def missing(self) -> str | None:
        try:
            read_glosses()
        except FileNotFoundError as err:
            return str(err)
        return None


def _gloss_data(seed: int, limit: int | None, eval_samples: int | None, batch_size: int):
    return GlossChars(batch_size=batch_size, seed=seed, limit=limit, eval_samples=eval_samples)


MORE_TASKS: dict[str, Task] = {
    "wordnet_glosses": _GlossTask(
        name="wordnet_glosses",
        title="WordNet glosses char-LM, transformer d=96 x 4 blocks, dropout 0.1, context 128, 4 stages",
        metric="val_loss", metric_label="validation loss (held-out glosses)", higher_is_better=False,
        source="wordnet", split_points=["blocks.1", "blocks.2", "blocks.3"], microbatches=8, batch_size=32,
        make_data=_gloss_data,
        make_model=lambda dm: _char_transformer()(dm.vocab_size, block_size=128, d=96, heads=4, layers=4,
                                                  dropout=0.1, lr=1e-3, warmup=20),
        add_bottlenecks=blocks_bottlenecks, gradient_clip_val=1.0),
    "fashion_vit": Task(
        name="fashion_vit",
        title="Fashion-MNIST, vision transformer (4x4 patches, d=64 x 4 blocks), 4 stages",
        metric="val_acc", metric_label="test accuracy (official test split)", higher_is_better=True,
        source="fashion_mnist", split_points=["blocks.1", "blocks.2", "blocks.3"], microbatches=4, batch_size=128,
        make_data=_fashion_data, make_model=lambda dm: FashionViT(), add_bottlenecks=blocks_bottlenecks,
        gradient_clip_val=1.0),
    "shakespeare_d256": Task(
        name="shakespeare_d256",
        title="Shakespeare char-LM, transformer d=256 x 4 blocks, context 128, 4 stages",
        metric="val_loss", metric_label="validation loss (held-out plays)", higher_is_better=False,
        source="shakespeare", split_points=["blocks.1", "blocks.2", "blocks.3"], microbatches=8, batch_size=32,
        make_data=TASKS["shakespeare"].make_data,
        make_model=lambda dm: _char_transformer()(dm.vocab_size, block_size=128, d=256, heads=4, layers=4,
                                                  dropout=0.0, lr=1e-3, warmup=20),
        add_bottlenecks=blocks_bottlenecks, gradient_clip_val=1.0),
}
#: tasks quality.py runs only when named in --tasks
OPT_IN_TASKS = ("shakespeare_d256",)
#: per quality.py mode: steps, validation interval, train/eval subsets (the "standard" lengths are the longer runs
#: issue #35 asks for: 480 steps of text, 2 epochs of Fashion-MNIST)
MODE_SETTINGS: dict[str, dict[str, dict]] = {
    "tiny": {"wordnet_glosses": {"steps": 2, "val_every": 2, "limit": 128, "eval_samples": 64},
             "fashion_vit": {"steps": 2, "val_every": 2, "limit": 512, "eval_samples": 500},
             "shakespeare_d256": {"steps": 2, "val_every": 2, "limit": 128, "eval_samples": 64}},
    "quick": {"wordnet_glosses": {"steps": 40, "val_every": 20, "limit": None, "eval_samples": 128},
              "fashion_vit": {"steps": 120, "val_every": 40, "limit": None, "eval_samples": 2000},
              "shakespeare_d256": {"steps": 40, "val_every": 20, "limit": None, "eval_samples": 128}},
    # shakespeare_d256 at the longer length of issue #35's Shakespeare runs (the standard 120 steps x 4)
    "standard": {"wordnet_glosses": {"steps": 480, "val_every": 60, "limit": None, "eval_samples": 256},
                 "fashion_vit": {"steps": 860, "val_every": 172, "limit": None, "eval_samples": 2000},
                 "shakespeare_d256": {"steps": 480, "val_every": 120, "limit": None, "eval_samples": 256}},
    "full": {"wordnet_glosses": {"steps": 960, "val_every": 120, "limit": None, "eval_samples": 512},
             "fashion_vit": {"steps": 1720, "val_every": 172, "limit": None, "eval_samples": None},
             "shakespeare_d256": {"steps": 600, "val_every": 60, "limit": None, "eval_samples": 512}},
}
STEP_SECONDS = {"wordnet_glosses": 0.4, "fashion_vit": 0.2, "shakespeare_d256": 1.4}
EVAL_SECONDS = {"wordnet_glosses": 0.005, "fashion_vit": 0.001, "shakespeare_d256": 0.015}


#: what the two tasks run when ``--configs`` is unset: the reference, the mild codecs, and the bottleneck settings
#: of the frontier (about 21x, 32x, 32x and 62x fewer bytes)
DEFAULT_CONFIGS = ["uncompressed", "direct moderate", "direct bn4 moderate", "direct bn8 q8", "direct bn8 rescaled q8",
                   "direct bn16 rescaled q8"]


def register(tasks: dict, modes: dict, step_seconds: dict, eval_seconds: dict, task_configs: dict) -> None:
    """Add the two tasks to quality.py's tables (in place)."""
    tasks.update(MORE_TASKS)
    task_configs.update({name: DEFAULT_CONFIGS for name in MORE_TASKS})
    for mode, settings in MODE_SETTINGS.items():
        modes[mode]["tasks"].update(settings)
    step_seconds.update(STEP_SECONDS)
    eval_seconds.update(EVAL_SECONDS)
