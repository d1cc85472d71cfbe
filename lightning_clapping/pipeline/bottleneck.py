"""An opt-in, trainable boundary bottleneck: a low-rank down/up projection pair that a model puts where it is cut.

This is a **model change**, not a codec: ``Bottleneck(features, rank)`` is an ``nn.Module`` with two bias-free
linear maps, ``down`` (``features -> rank``) and ``up`` (``rank -> features``), and ``forward(x) = up(down(x))`` on
the last dimension. Put it in the model where a stage should end. A split point that names a ``Bottleneck`` cuts
between its two halves: ``down`` runs on the earlier stage, ``up`` on the later one, so the wire carries
``rank`` values per position instead of ``features`` (in both directions: the gradient that comes back has the
code's shape too), and any codec then compresses that code.

Because it is part of the model, everything else follows from Lightning as usual: the checkpoint holds ``down`` and
``up`` with the rest of the weights, and the model run in one process (inference, export, a Trainer without this
strategy) runs through the same projection it was trained with. It constrains what crosses the cut to a
``rank``-dimensional subspace that training learns; whether that costs quality is the model's business, and
BENCHMARKS.md measures it on the project's quality tasks.

At initialisation ``down`` has orthonormal rows and ``up`` is its transpose. With ``init="projection"`` (the
default) ``up(down(x))`` starts as an orthogonal projection onto a random ``rank``-dimensional subspace: an input
spread evenly over its ``features`` directions keeps ``rank / features`` of its energy. With ``init="rescaled"`` both
halves are multiplied by ``(features / rank) ** 0.25`` (balanced, so neither half's gradients dominate), which makes
``up(down(x))`` that projection times ``sqrt(features / rank)``: such an input keeps its expected squared norm. Which
one trains better is the model's business (BENCHMARKS.md section 1 measures both: the rescaled start suits an MLP
cut after its ReLUs, the projection suits a transformer's residual stream).

Models that call their blocks in a loop (Hugging Face transformers: ``for layer in self.layer: hidden =
layer(hidden, mask, ...)``) have no place to insert a module between two blocks. ``BottleneckAfter(block, features,
rank)`` wraps the block instead: it calls the block as the model calls it and passes what the block returns through
a ``Bottleneck``, so the model's own loop stays as it is, and the attributes the model reads from its blocks are read
from the wrapped one. The split point then names the bottleneck inside the wrapper (``"...layer.5.bottleneck"``).
Hidden states that transformers records from the block itself (``output_hidden_states=True``, by hooks on the
block's class) are the block's output before the bottleneck.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

INITS = ("projection", "rescaled")

__all__ = ["Bottleneck", "BottleneckAfter"]


class Bottleneck(nn.Module):
    """``up(down(x))`` with ``down: features -> rank`` and ``up: rank -> features``, both linear without bias."""

    def __init__(self, features: int, rank: int, init: str = "projection") -> None:
        super().__init__()
        for name, value in (("features", features), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Bottleneck: {name} must be a positive integer, got {value!r}")
        if rank >= features:
            raise ValueError(
                f"Bottleneck: rank {rank} must be smaller than features {features}; a bottleneck that is not "
                f"narrower than its input saves nothing on the wire (leave the model as it is instead)"
            )
        if init not in INITS:
            raise ValueError(f"Bottleneck: init must be one of {', '.join(map(repr, INITS))}, got {init!r}")
        self.features, self.rank, self.init = features, rank, init
        self.down = nn.Linear(features, rank, bias=False)
        self.up = nn.Linear(rank, features, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.orthogonal_(self.down.weight)  # [rank, features] with orthonormal rows
            self.up.weight.copy_(self.down.weight.t())
            if self.init == "rescaled":
                gain = (self.features / self.rank) ** 0.25
                self.down.weight.mul_(gain)
                self.up.weight.mul_(gain)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.features:
            raise ValueError(
                f"Bottleneck({self.features}, {self.rank}) got a tensor whose last dimension is {x.shape[-1]}; "
                f"build it with the width of the values it sits between"
            )
        return self.up(self.down(x))

    def extra_repr(self) -> str:
        return f"features={self.features}, rank={self.rank}, init={self.init!r}"


class BottleneckAfter(nn.Module):
    """``block`` followed by a :class:`Bottleneck` on what it returns (on the first element when it returns a tuple,
    as older Hugging Face blocks do), called with whatever arguments the model passes to the block."""

    def __init__(self, block: nn.Module, features: int, rank: int, init: str = "projection") -> None:
        super().__init__()
        self.block, self.bottleneck = block, Bottleneck(features, rank, init)

    def __getattr__(self, name: str):
        # what the model reads from its block (e.g. a layer's attention type) is read from the wrapped block
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self._modules.get("block")
            if block is None or name == "block":
                raise
            return getattr(block, name)

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        if isinstance(out, tuple):
            return (self.bottleneck(out[0]), *out[1:])
        return self.bottleneck(out)
