"""The residual bottleneck's settings in ``quality.py`` (the longer-run study of the bottleneck's cost, BENCHMARKS.md):
``Bottleneck(..., residual=True)``, a learned encoder and decoder around the same low-rank identity path, the same
code on the wire, at width / 8 and / 16 with codecs on its code, alone, and with one bit per value on the code under
Clapping-FC's error feedback. They run only where ``--configs`` names them::

    python benchmarks/quality.py --standard --tasks shakespeare --steps-scale 4 --val-every 60 \\
        --configs uncompressed "direct bn8 q8" "direct bn8 residual q8" --out benchmarks/results/frontier_long
"""

from __future__ import annotations

import torch

#: codec setting -> (forward codec, backward codec, fresh codec), as quality.py's CODEC_SETTINGS
RESIDUAL_CODECS: dict[str, tuple[str | None, str | None, str | None]] = {
    "bn8 residual": (None, None, None),
    "bn8 residual q8": ("q8", "q8", None),
    "bn16 residual q8": ("q8", "q8", None),
    "bn16 residual moderate": ("q4", "q8", None),
    "bn8 residual q1": ("q1", "q1", None),
}
#: codec settings whose Bottleneck at every cut is the residual one: (width divisor, init) as in _quality_tasks'
#: BOTTLENECK, which holds them too (the report marks them as model changes); see residual_bottlenecks
RESIDUAL: dict[str, tuple[int, str]] = {
    "bn8 residual": (8, "projection"),
    "bn8 residual q8": (8, "projection"),
    "bn16 residual q8": (16, "projection"),
    "bn16 residual moderate": (16, "projection"),
    "bn8 residual q1": (8, "projection"),
}
#: (variant, p, codec setting) of the opt-in frontier configurations
OPT_IN_CONFIGS: list[tuple[str, float, str]] = [
    ("uncompressed", 1.0, "bn8 residual"),
    ("direct", 1.0, "bn8 residual q8"),
    ("direct", 1.0, "bn16 residual q8"),
    ("direct", 1.0, "bn16 residual moderate"),
    ("clapping-fc", 0.5, "bn8 residual q1"),
]


def residual_bottlenecks(model: torch.nn.Module) -> None:
    """Every ``Bottleneck`` of ``model`` replaced by ``Bottleneck(..., residual=True)`` of the same width, rank and
    init, holding the same identity path: the same start as the plain bottleneck of the run's seed, whose encoder and
    decoder branches (started at zero output) can then learn a nonlinear code."""
    from lightning_clapping import Bottleneck

    for name, old in [(n, m) for n, m in model.named_modules() if isinstance(m, Bottleneck) and not m.residual]:
        new = Bottleneck(old.features, old.rank, old.init, residual=True)
        with torch.no_grad():
            new.down.weight.copy_(old.down.weight)
            new.up.weight.copy_(old.up.weight)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
