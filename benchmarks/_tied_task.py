"""A quality task with weights tied across stages: ``shakespeare_tied``.

The ``shakespeare`` task of ``_quality_tasks.py`` (the same data, the same held-out windows, the same batch size,
micro-batches, clipping and optimizer) with the character transformer's token embedding and output head tied: the
head's weight *is* the embedding's ``nn.Parameter`` (``model.head.weight is model.tok.weight``, shape
``[vocab, d]``). Cut into stages, the embedding runs on the first stage and the head on the last, so the strategy
finds the tensor under two names on two stages (a tied group of the partition): each of the two stages trains a copy
and the copies' gradients are summed between them every optimizer step, the sum ``tied_codec=`` compresses.

One change besides the tie, so that one tensor suits both of its uses at the start: the shared tensor starts from
N(0, 1 / d) and the embedding's output is multiplied by sqrt(d) (the scaling of the original transformer, which tied
these two weights). The input then starts at the scale of the untied model's N(0, 1) embedding, and the head's
logits at about unit scale. Without it the head would start from the embedding's N(0, 1) weights, logits of about
sqrt(d) = 11 standard deviations.

``shakespeare_untied_twin`` is the control: the same model, started from the same values (the head's weight a copy
of the embedding's), with the two tensors trained apart. What differs between the two tasks is the tie alone.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from _quality_tasks import Task, _char_transformer, _shakespeare_data, blocks_bottlenecks

CharTransformer = _char_transformer()


class TiedCharTransformer(CharTransformer):
    """``examples/char_lm.py``'s CharTransformer with ``head.weight`` the same parameter as ``tok.weight`` (``tie``;
    else a parameter of its own that starts as a copy of it)."""

    def __init__(self, vocab_size: int, block_size: int = 128, d: int = 128, heads: int = 4, layers: int = 4,
                 dropout: float = 0.0, lr: float = 1e-3, warmup: int = 20, tie: bool = True) -> None:
        super().__init__(vocab_size, block_size=block_size, d=d, heads=heads, layers=layers, dropout=dropout, lr=lr,
                         warmup=warmup)
        torch.nn.init.normal_(self.tok.weight, std=d ** -0.5)
        # tied: one nn.Parameter, the input embedding and the output head
        self.head.weight = self.tok.weight if tie else torch.nn.Parameter(self.tok.weight.detach().clone())
        self.scale = math.sqrt(d)

    def forward(self, idx):
        x = self.tok(idx) * self.scale + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


SHAKESPEARE_TIED = Task(
    name="shakespeare_tied",
    title="Shakespeare char-LM, transformer d=128 x 4 blocks, context 128, embedding and output head tied",
    metric="val_loss",
    metric_label="validation loss (held-out plays)",
    higher_is_better=False,
    source="shakespeare",
    split_points=["blocks.1", "blocks.2", "blocks.3"],
    microbatches=8,
    batch_size=32,
    make_data=_shakespeare_data,
    make_model=lambda dm: TiedCharTransformer(dm.vocab_size, block_size=128, d=128, heads=4, layers=4, dropout=0.0,
                                              lr=1e-3, warmup=20),
    add_bottlenecks=blocks_bottlenecks,
    gradient_clip_val=1.0,
)

UNTIED_TWIN = dataclasses.replace(
    SHAKESPEARE_TIED, name="shakespeare_untied_twin",
    title="Shakespeare char-LM, shakespeare_tied's model and start with the embedding and output head trained apart",
    make_model=lambda dm: TiedCharTransformer(dm.vocab_size, block_size=128, d=128, heads=4, layers=4, dropout=0.0,
                                              lr=1e-3, warmup=20, tie=False))

#: name -> task, to merge into ``_quality_tasks.TASKS`` where a benchmark runs it
TIED_TASKS: dict[str, Task] = {t.name: t for t in (SHAKESPEARE_TIED, UNTIED_TWIN)}
