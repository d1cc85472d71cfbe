"""What slow_network runs: the links (``LinkSpec``, ``--links``, ``--sites``), the modes (tiny, quick, full), the
variants of every link and of loopback, per-boundary codec strings, and the results' file stem.

Nothing here imports torch: the launcher only starts the ranks and waits for them.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


@dataclass(frozen=True)
class LinkSpec:
    """One network setting the variants run on: a rate, and a one-way delay or None (kernel veth + tbf, no relay).
    ``sites``: one site per pipeline stage (delayed links only); rate and delay then apply between sites only, and
    the label and key say so, so a mixed cluster never reads as a uniform one."""

    rate_mbit: float
    delay_ms: float | None = None
    sites: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        return (f"{self.rate_mbit:g} Mbit/s" + ("" if self.delay_ms is None else f" {self.delay_ms:g} ms")
                + ("" if self.sites is None else f" (sites {','.join(map(str, self.sites))})"))

    @property
    def key(self) -> str:
        return (f"{self.rate_mbit:g}mbit" + ("" if self.delay_ms is None else f"_{self.delay_ms:g}ms")
                + ("" if self.sites is None else f"_sites{'-'.join(map(str, self.sites))}"))

    @property
    def kind(self) -> str:
        return "veth+tbf" if self.delay_ms is None else "tun+relay"


def parse_link(text: str) -> LinkSpec:
    """``100`` (veth + tbf), ``100@25`` or ``100@25ms`` (the relay, 25 ms each way), ``100@0`` (relay, no delay)."""
    rate, sep, delay = text.strip().partition("@")
    try:
        spec = LinkSpec(float(rate), float(delay.removesuffix("ms")) if sep else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a link is RATE or RATE@DELAY_MS (Mbit/s, ms), e.g. 100 or 100@25; got "
                                         f"{text!r}") from None
    if spec.rate_mbit <= 0 or (spec.delay_ms is not None and spec.delay_ms < 0):
        raise argparse.ArgumentTypeError(f"rate must be > 0 and delay >= 0, got {text!r}")
    return spec


def parse_sites(text: str) -> tuple[int, ...]:
    """``0,0,1,1``: the site of each pipeline stage (stage 0 first), at least two different sites (else nothing
    would cross the slow link)."""
    try:
        sites = tuple(int(x) for x in text.split(","))
    except ValueError:
        sites = None
    if not sites or any(x < 0 for x in sites):
        raise argparse.ArgumentTypeError(f"--sites is one site number (0, 1, ...) per stage, comma-separated, e.g. "
                                         f"0,0,1,1; got {text!r}")
    if len(set(sites)) < 2:
        raise argparse.ArgumentTypeError(f"--sites needs at least two sites (with one, no traffic crosses the slow "
                                         f"link); got {text!r}")
    return sites


def apply_sites(links: list[LinkSpec], sites: tuple[int, ...] | None, stages: int) -> list[LinkSpec]:
    """Every link with these sites; refused unless every link is delayed (the relay keeps a site's LAN apart from
    the slow link) and there is one site per stage."""
    if sites is None:
        return links
    plain = [x.label for x in links if x.delay_ms is None]
    if plain:
        raise SystemExit(f"--sites needs delayed links (the user-space relay): give every link as RATE@DELAY, e.g. "
                         f"25@25, or add --delay-ms; these have none: {', '.join(plain)}")
    if len(sites) != stages:
        raise SystemExit(f"--sites: {stages} stages need {stages} site numbers, got {len(sites)} "
                         f"({','.join(map(str, sites))})")
    return [LinkSpec(x.rate_mbit, x.delay_ms, tuple(sites)) for x in links]


def codec_arg(text: str, boundaries: int, get_codec=None):
    """A codec setting as ``ClappingStrategy`` takes it. A plain name (``q4``) stays as it is. A per-boundary list,
    ``b0,b1,...`` with one entry per boundary and ``-`` for uncompressed (``-,q4,-``: only boundary 1 compressed),
    becomes ``{boundary: codec}`` without the uncompressed ones (the strategy sends a boundary missing from the map
    uncompressed). ``get_codec`` (``lightning_clapping.codecs.get_codec``), when given, checks every name; the
    launcher leaves it out (it never imports torch) and the worker passes it. Raises ValueError."""
    text = text.strip()
    if "," not in text and text != "-":
        return text
    names = [x.strip() for x in text.split(",")]
    if len(names) != boundaries:
        raise ValueError(f"per-boundary codecs {text!r}: {boundaries} boundaries need {boundaries} entries, got "
                         f"{len(names)} (each a codec, or - for uncompressed)")
    out = {}
    for b, name in enumerate(names):
        if not name:
            raise ValueError(f"per-boundary codecs {text!r}: boundary {b} is empty (write - for uncompressed)")
        if name == "-":
            continue
        if get_codec is not None:
            try:
                get_codec(name)
            except (ValueError, TypeError) as err:
                raise ValueError(f"per-boundary codecs {text!r}, boundary {b}: {err}") from None
        out[b] = name
    return out


def check_variant_codecs(variants: list[Variant], boundaries: int) -> None:
    """Refuse a per-boundary codec list of the wrong length before anything is built."""
    for v in variants:
        for text in (v.forward_codec, v.backward_codec):
            try:
                codec_arg(text, boundaries)
            except ValueError as err:
                raise SystemExit(f"slow_network: {v.label}: {err}") from None


def _ms(text: str) -> float:
    """tc-style time (``100ms``, ``0.1s``, ``500us``) in milliseconds."""
    for suffix, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1e3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text) * 1e-3  # tc reads a bare number as microseconds


@dataclass(frozen=True)
class Variant:
    """One row of a link's runs: a ``ClappingStrategy`` variant with its codecs, lazy-sampling p and options."""

    label: str
    variant: str
    p: float = 1.0  # lazy sampling: probability of a fresh batch (1.0: plain data module, except for aqsgd)
    forward_codec: str = "q4"
    backward_codec: str = "q8"
    autotune: bool = False  # ClappingStrategy(autotune=True): the strategy picks each boundary's codecs itself
    schedule: str | None = None  # this row's own schedule ("auto": autotune may switch); None: the run's --schedule
    fresh_codec: str | None = None  # ClappingStrategy(fresh_codec=...): the codec of fresh steps (None: as without)
    #: a model change: a trainable lightning_clapping.Bottleneck of width d / bottleneck before every cut, the cut
    #: between its halves (None: the model as it is)
    bottleneck: int | None = None
    #: lazy sampling's p from a later step on, (step, p): LazySamplingDataModule(p={0: p, step: later p}) (None: p)
    p_later: tuple[int, float] | None = None

    @property
    def sample_ids(self) -> bool:
        """AQ-SGD keeps one buffer per training sample: its data is wrapped in LazySamplingDataModule(p=1), which
        changes nothing but reports the sample ids."""
        return self.variant == "aqsgd"


@dataclass
class Mode:
    """The size of a run (tiny, quick or full): pipeline and model, batch, steps, validation, the links."""

    name: str
    stages: int = 4
    d: int = 128
    heads: int = 4
    layers: int = 4
    block: int = 128
    batch: int = 32
    microbatches: int = 8
    steps: int = 400
    val_every: int = 25
    val_batches: int = 8
    skip: int = 10  # first steps left out of the median step time
    links: list[LinkSpec] = field(default_factory=lambda: [LinkSpec(100.0), LinkSpec(25.0)])
    data_limit: int | None = None
    seed: int = 0


def make_mode(args: argparse.Namespace) -> Mode:
    """The mode the options ask for, with their steps, validation, seed and links (``--delay-ms``, ``--sites``)."""
    if args.tiny:
        mode = Mode("tiny", stages=2, d=32, heads=2, layers=2, block=32, batch=8, microbatches=2, steps=3,
                    val_every=3, val_batches=1, skip=1, links=[LinkSpec(100.0)], data_limit=256)
    elif args.quick:
        mode = Mode("quick", steps=60, val_every=20, val_batches=4, skip=5)
    else:
        mode = Mode("full")
    for name in ("steps", "val_every", "val_batches", "skip", "seed"):
        if getattr(args, name) is not None:
            setattr(mode, name, getattr(args, name))
    if args.links is not None:
        mode.links = list(args.links)
    if args.delay_ms is not None:  # every link given without its own delay gets this one
        mode.links = [LinkSpec(x.rate_mbit, args.delay_ms) if x.delay_ms is None else x for x in mode.links]
    mode.links = apply_sites(mode.links, getattr(args, "sites", None), mode.stages)
    if mode.steps % mode.val_every:
        raise SystemExit(f"--steps ({mode.steps}) must be a multiple of --val-every ({mode.val_every}), so the last "
                         "step is validated")
    return mode


@functools.lru_cache(maxsize=None)
def strategy_accepts(name: str) -> bool:
    """Whether this version of ``lightning_clapping.ClappingStrategy`` takes the keyword ``name`` (``autotune`` is
    newer than this script's other settings). Asked in a child process: the launcher itself never imports torch."""
    code = ("import inspect, sys, lightning_clapping as lc; "
            "sys.exit(0 if sys.argv[1] in inspect.signature(lc.ClappingStrategy).parameters else 3)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, 3):
        raise SystemExit(f"slow_network: cannot import lightning_clapping:\n{proc.stderr[-2000:]}")
    return proc.returncode == 0


def _p_later(text: str) -> tuple[int, float] | None:
    """``P2@STEP`` as (STEP, P2), None when malformed."""
    p2, _, step = text.partition("@")
    try:
        value = float(p2)
    except ValueError:
        return None
    return (int(step), value) if step.isdigit() and int(step) > 0 and 0 < value <= 1 else None


def make_variants(args: argparse.Namespace) -> list[Variant]:
    """The runs of every shaped link, in table order: uncompressed; the baselines direct and AQ-SGD (same codecs as
    Clapping, no lazy sampling); clapping-fc (and its --fc-extra codec pairs); clapping-fu; and "auto" (clapping-fc
    with autotune, when the strategy has it). --no-direct / --no-aqsgd / --no-auto leave a row out; --tiny keeps
    uncompressed, the baselines, clapping-fc and auto."""
    fwd, bwd = args.forward_codec, args.backward_codec
    out = [Variant("uncompressed", "uncompressed")]
    if not getattr(args, "no_direct", False):
        out.append(Variant("direct", "direct", 1.0, fwd, bwd))
    if not getattr(args, "no_aqsgd", False):
        out.append(Variant("aqsgd", "aqsgd", 1.0, fwd, bwd))
    out.append(Variant(f"clapping-fc p={args.p:g}", "clapping-fc", args.p, fwd, bwd))
    if not args.tiny:
        for pair in args.fc_extra:
            extra_fwd, _, extra_bwd = pair.partition("/")
            if not extra_fwd or not extra_bwd:
                raise SystemExit(f"--fc-extra takes FORWARD/BACKWARD codec pairs such as q4/q4, got {pair!r}")
            out.append(Variant(f"clapping-fc p={args.p:g} {pair}", "clapping-fc", args.p, extra_fwd, extra_bwd))
        out += [Variant(f"clapping-fu p={p:g}", "clapping-fu", p, fwd, bwd) for p in args.fu_p]
        if getattr(args, "frontier", False):
            out.append(FRONTIER)
        for text in getattr(args, "bottleneck", None) or []:
            divisor, _, rest = text.partition(":")
            pair, _, rest = rest.partition(":")
            variant, _, later = rest.partition(":")
            bn_fwd, _, bn_bwd = pair.partition("/")
            variant = variant or "direct"
            p_later = _p_later(later) if later and variant != "direct" else None
            if (not divisor.isdigit() or int(divisor) < 2 or not bn_fwd or not bn_bwd
                    or variant not in ("direct", "clapping-fc", "clapping-fu") or (later and p_later is None)):
                raise SystemExit(f"--bottleneck takes N:FORWARD/BACKWARD[:VARIANT[:P2@STEP]] such as 8:q8/q8, "
                                 f"8:q4/q8:clapping-fc or 8:q4/q8:clapping-fc:1@125 (N >= 2 divides the width; VARIANT "
                                 f"direct, clapping-fc or clapping-fu, at --p, then at P2 in (0, 1] from step STEP), "
                                 f"got {text!r}")
            p = 1.0 if variant == "direct" else args.p
            label = f"{variant}{'' if variant == 'direct' else f' p={p:g}'}"
            label += f" then {p_later[1]:g} from {p_later[0]}" if p_later else ""
            out.append(Variant(f"{label} bn{divisor} {pair}", variant, p, bn_fwd, bn_bwd, bottleneck=int(divisor),
                               p_later=p_later))
    if not getattr(args, "no_auto", False) and strategy_accepts("autotune"):
        out.append(Variant(f"auto p={args.p:g}", "clapping-fc", args.p, fwd, bwd, autotune=True))
        if getattr(args, "auto_schedule", False):
            out.append(Variant(f"auto p={args.p:g} schedule=auto", "clapping-fc", args.p, fwd, bwd, autotune=True,
                               schedule="auto"))
    return out


#: the best configuration of the compression frontier on the char-LM (BENCHMARKS section 1: 14.3x fewer bytes at
#: +2.70 % validation loss): 10 % random values at 4 bits on reuse steps, fresh steps at q4 with fp16 scales
FRONTIER = Variant("clapping-fu p=0.5 randk fresh-q4", "clapping-fu", 0.5, "randk:0.1+q4", "randk:0.1+q4",
                   fresh_codec="q4:fp16")


def loopback_variants(variants: list[Variant], args: argparse.Namespace) -> list[Variant]:
    """On loopback: uncompressed (the communication-free limit) and, unless --no-loopback-fc or --tiny, the main
    clapping-fc (it shows the codecs' compute cost without a network). With --loopback-only every variant: the loss
    trajectories do not depend on the link, so loopback gives them without a shaped link's cost."""
    if getattr(args, "loopback_only", False):
        return list(variants)
    out = [v for v in variants if v.variant == "uncompressed"]
    if not (args.no_loopback_fc or args.tiny):
        out += [v for v in variants if v.variant == "clapping-fc" and not v.autotune][:1]
    return out


def output_stem(mode: Mode, args: argparse.Namespace) -> str:
    """File names of the results: ``--stem``, else ``slow_network`` with ``_delay`` when a link has a delay,
    ``_mixed`` when the stages are in sites and ``_quick`` in quick mode, so a quick, delayed or mixed run never
    overwrites the full run's files."""
    if args.stem:
        return args.stem
    delayed = any(x.delay_ms is not None for x in mode.links)
    mixed = any(x.sites is not None for x in mode.links)
    return ("slow_network" + ("_delay" if delayed else "") + ("_mixed" if mixed else "")
            + ("_quick" if mode.name == "quick" else ""))


def fp32_message_bytes(mode: Mode) -> int:
    """Bytes of one fp32 activation (or gradient) of a whole batch at one boundary: batch x block x d x 4."""
    return mode.batch * mode.block * mode.d * 4
