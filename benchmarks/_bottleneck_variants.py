"""The bottleneck's variants in ``quality.py`` (the longer-run study of the bottleneck's cost, BENCHMARKS.md). They
run only where ``--configs`` names them::

    python benchmarks/quality.py --standard --tasks shakespeare --steps-scale 4 --val-every 60 \\
        --configs uncompressed "direct bn8 q8" "direct bn8 residual q8" --out benchmarks/results/frontier_long

* The residual bottleneck: ``Bottleneck(..., residual=True)``, a learned encoder and decoder around the same low-rank
  identity path, the same code on the wire, at width / 8 and / 16 with codecs on its code, alone, and with one bit
  per value on the code under Clapping-FC's error feedback.
* A code that widens (``lightning_clapping.RankScheduler``): ``bn8-to-bn2 moderate`` is a ``Bottleneck(w, w / 2)``
  at every cut that codes w / 8 values per position until 70 % of the steps, then all w / 2 of its rank (q4 forward,
  q8 backward on the code); ``bn8-to-bn4 moderate`` a ``Bottleneck(w, w / 4)`` coding w / 8 for the first half.
* Ranks chosen per cut from the measured energy (``bn4 energy moderate``): the same number of values per position
  over the cuts as ``bn4`` (3 x w / 4 for 3 cuts), shared out in proportion to how many directions keep 95 % of the
  energy at each cut at the end of the uncompressed run (``cut_energy.py``, ``results/cut_energy.json``).
* An affine bottleneck (``bn4 affine moderate``): ``bn4 moderate`` whose two halves also learn a bias (started at
  zero), so the code need not carry what every position shares (the bias of ``up`` adds it back at no cost in bytes).
* Two bits per value on the code of ``bn4``, both ways (``bn4 q2``) or forward only with 4-bit gradients
  (``bn4 aggressive``), plain and under Clapping-FC's error feedback with lazy sampling at p = 0.5.
* A start fitted to the data when training from scratch: ``bn4 fitted moderate`` is ``bn4 moderate`` whose
  bottlenecks start from the principal directions of what reaches them at initialisation (``fit_bottlenecks`` on the
  run's first training batches, as the fine-tuning task's ``pca`` starts).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import lightning_clapping
from lightning_clapping.pipeline.bottleneck import bottlenecks_of

ENERGY = Path(__file__).resolve().parent / "results" / "cut_energy.json"

#: codec setting -> (forward codec, backward codec, fresh codec), as quality.py's CODEC_SETTINGS
VARIANT_CODECS: dict[str, tuple[str | None, str | None, str | None]] = {
    "bn8 residual": (None, None, None),
    "bn8 residual q8": ("q8", "q8", None),
    "bn16 residual q8": ("q8", "q8", None),
    "bn16 residual moderate": ("q4", "q8", None),
    "bn8 residual q1": ("q1", "q1", None),
    "bn8-to-bn2 moderate": ("q4", "q8", None),
    "bn8-to-bn4 moderate": ("q4", "q8", None),
    "bn4 fitted moderate": ("q4", "q8", None),
    "bn4 q2": ("q2", "q2", None),
    "bn4 aggressive": ("q2", "q4", None),
    "bn4 energy moderate": ("q4", "q8", None),
    "bn4 affine moderate": ("q4", "q8", None),
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
#: codec settings whose code widens: (width divisor of the Bottleneck, width divisor of the code before the change,
#: fraction of the steps from which the code is the full rank)
WIDENING: dict[str, tuple[int, int, float]] = {
    "bn8-to-bn2 moderate": (2, 8, 0.7),
    "bn8-to-bn4 moderate": (4, 8, 0.5),
}
#: every variant's Bottleneck: (width divisor, init) for _quality_tasks' BOTTLENECK
VARIANT_BOTTLENECKS: dict[str, tuple[int, str]] = {
    **RESIDUAL, **{setting: (divisor, "projection") for setting, (divisor, _, _) in WIDENING.items()},
    "bn4 fitted moderate": (4, "pca"),  # "pca": quality.py fits it (_quality_tasks.fit_to_data)
    **{setting: (4, "projection") for setting in ("bn4 q2", "bn4 aggressive", "bn4 energy moderate",
                                                   "bn4 affine moderate")}}
#: (variant, p, codec setting) of the opt-in frontier configurations
OPT_IN_CONFIGS: list[tuple[str, float, str]] = [
    ("uncompressed", 1.0, "bn8 residual"),
    ("direct", 1.0, "bn8 residual q8"),
    ("direct", 1.0, "bn16 residual q8"),
    ("direct", 1.0, "bn16 residual moderate"),
    ("clapping-fc", 0.5, "bn8 residual q1"),
    ("direct", 1.0, "bn8-to-bn2 moderate"),
    ("direct", 1.0, "bn8-to-bn4 moderate"),
    ("direct", 1.0, "bn4 fitted moderate"),
    ("direct", 1.0, "bn4 q2"),
    ("clapping-fc", 0.5, "bn4 q2"),
    ("direct", 1.0, "bn4 aggressive"),
    ("clapping-fc", 0.5, "bn4 aggressive"),
    ("direct", 1.0, "bn4 energy moderate"),
    ("direct", 1.0, "bn4 affine moderate"),
]


def variant_model(setting: str, model: torch.nn.Module, task: str) -> None:
    """The model of a variant setting, changed in place (its plain bottlenecks already inserted)."""
    if setting in RESIDUAL:
        residual_bottlenecks(model)
    if setting == "bn4 energy moderate":
        end = json.loads(ENERGY.read_text())[task]["points"][-1]["cuts"]
        found = bottlenecks_of(model, setting)  # in the order the forward reaches the cuts (the order inserted)
        ranks = shared_out(sum(b.rank for b in found.values()), [cut["directions"]["95 %"] for cut in end.values()])
        for (name, b), r in zip(found.items(), ranks, strict=True):
            model.set_submodule(name, lightning_clapping.Bottleneck(b.features, r, b.init))
    if setting == "bn4 affine moderate":
        for b in bottlenecks_of(model, setting).values():
            for half in (b.down, b.up):
                half.bias = torch.nn.Parameter(torch.zeros(half.out_features))


def shared_out(total: int, weights: list[int]) -> list[int]:
    """``total`` (at least one per weight) shared out in proportion to ``weights``: largest remainders first, at
    least 1 each, what the minimum of 1 adds taken back from the largest shares."""
    exact = [total * w / sum(weights) for w in weights]
    out = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder[:max(0, total - sum(out))]:
        out[i] += 1
    while sum(out) > total:
        out[out.index(max(out))] -= 1
    return out


def variant_callbacks(setting: str, model: torch.nn.Module, steps: int) -> list[lightning_clapping.RankScheduler]:
    """A widening setting's ``RankScheduler`` for a run of ``steps`` (none for other settings): the code's width
    first the model's width / the setting's earlier divisor, the full rank from its fraction of the steps."""
    if setting not in WIDENING:
        return []
    _, before, fraction = WIDENING[setting]
    found = bottlenecks_of(model, setting).values()
    features = {b.features for b in found}
    if len(features) != 1:
        raise ValueError(f"{setting}: the bottlenecks must share one width to share a schedule, got {features}")
    rank = max(b.rank for b in found)
    return [lightning_clapping.RankScheduler({0: features.pop() // before, round(fraction * steps): rank})]


def residual_bottlenecks(model: torch.nn.Module) -> None:
    """Every ``Bottleneck`` of ``model`` replaced by ``Bottleneck(..., residual=True)`` of the same width, rank and
    init, holding the same identity path: the same start as the plain bottleneck of the run's seed, whose encoder and
    decoder branches (started at zero output) can then learn a nonlinear code."""
    for name, old in [(n, m) for n, m in bottlenecks_of(model, "residual_bottlenecks").items() if not m.residual]:
        new = lightning_clapping.Bottleneck(old.features, old.rank, old.init, residual=True)
        with torch.no_grad():
            new.down.weight.copy_(old.down.weight)
            new.up.weight.copy_(old.up.weight)
        model.set_submodule(name, new)
