"""Time on a real slow network: the char-LM pipeline over shaped links, uncompressed against Clapping.

    python benchmarks/slow_network.py [--quick | --tiny] [--out benchmarks/results]     (as root, Linux)
    python benchmarks/slow_network.py --links 100@0 100@25 25@25 [--validate-only]    (links with one-way delay)

Every rank of a 4-stage pipeline runs in its own network namespace; the namespaces hang off a bridge through veth
links whose egress is limited by ``tc ... tbf rate R burst 8kb latency 100ms`` (see ``benchmarks/_netns.py``), so
gloo's traffic really crosses a 100 Mbit/s or 25 Mbit/s link. The communication-free limit runs the same pipeline
with all ranks in one namespace on its loopback. The script builds the namespaces itself, starts the ranks itself
(``ip netns exec NS python benchmarks/slow_network.py --worker CFG``, environment as torchrun sets it:
``MASTER_ADDR`` = address of global rank 0, which holds the LAST stage, ``MASTER_PORT``, ``WORLD_SIZE``,
``NODE_RANK``, ``LOCAL_RANK=0``, ``GLOO_SOCKET_IFNAME``; the Trainer uses ``devices=1, num_nodes=4`` and
Lightning's default LightningEnvironment reads those variables), and deletes everything it created at exit, also
on failure or on SIGINT/SIGTERM/SIGHUP.

Links with one-way delay (``--links RATE@DELAY``, e.g. ``100@25``, or ``--delay-ms D`` for every link given without
one): this kernel has no netem, so such a link is made in user space (``benchmarks/_delay_link.py``): each stage
namespace also has a TUN device ``d<i>`` (address 10.77.1.<i+1>, MTU 1500), and one relay process moves every packet
between them with the link rate per sender (no burst), a queue bound of ``--latency`` (tail drop, like tbf's) and the
delay: a packet from one stage reaches any other ``DELAY`` ms after its last bit left the sender, so the round trip is
2 x DELAY. ``100@0`` is the same relay without delay: compare 0 and 25 ms on one mechanism. A link without ``@`` is the
kernel veth + tbf link as before. Each configured link is checked before its runs: a UDP echo between two stage
namespaces gives the round-trip time (expect 2 x delay) and a 2-second TCP transfer the throughput (TCP payload, at
most 1448/1500 of the rate); the table is printed with the results and saved under ``links`` in the JSON, and every
run on a delayed link records the relay's own counters (``relay``: drops, how late it delivered, its CPU time).
``--validate-only`` builds the links, prints that table and exits. On a delayed link a synchronous step cannot be
shorter than the loopback step plus 2 x (stages - 1) x delay (fill and drain): the report gives that floor ("delay
floor") and each step's ratio to it ("x floor").

A mixed cluster (``--sites 0,0,1,1``: one site per stage, delayed links only): the relay lets packets between stages
of one site pass at once (a LAN) and applies the link's rate and delay between sites only, so with 0,0,1,1 only
boundary 1 is slow. The link's label and key carry the sites (``25 Mbit/s 25 ms (sites 0,0,1,1)``), the file stem gets
``_mixed``, the link check measures two neighbouring stages in different sites and reports two in one site next to
it (expect neither delay nor rate limit), and the delay floor counts the boundaries between sites only. Codecs may be
given per boundary, ``-`` for uncompressed (``codec_arg``): ``--fc-extra "-,q4,-/-,q8,-"`` is clapping-fc that
compresses boundary 1 only (4-bit forward, 8-bit backward) and sends boundaries 0 and 2 uncompressed.

Model and data: ``CharTransformer(vocab, block_size=128, d=128, heads=4, layers=4)`` from examples/char_lm.py, one
block per stage, Shakespeare windows of 128 characters, batch 32, 8 micro-batches, 1F1B, AdamW with warm-up; fp32
messages are then 2 MiB per link and direction per step. Each rank uses one CPU thread (``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)``): four ranks share a small CPU without oversubscribing it.

Variants, all with the same seed, steps and optimizer: uncompressed; the baselines direct (the same codecs, 4-bit
forward / 8-bit backward, no error feedback, no lazy sampling; ``--no-direct`` leaves it out) and AQ-SGD (per-sample
forward buffers, a sample's first visit sent in full, gradients compressed directly, p = 1; its data wrapped in
``LazySamplingDataModule(p=1)`` for the sample ids; ``--no-aqsgd``); clapping-fc (4-bit forward, 8-bit backward,
lazy sampling p=0.5); on the shaped links also clapping-fc with 4-bit messages both ways (``--fc-extra``) and
clapping-fu with the first codecs at p=0.5 and p=0.2; and "auto": clapping-fc at p=0.5 with ``autotune=True``, only
when ``ClappingStrategy`` has that parameter (``--no-auto``). ``--tiny`` runs uncompressed, direct, AQ-SGD,
clapping-fc and auto. Measured per run: the median step time on rank 0 (wall time from ``on_train_batch_start`` to
``on_train_batch_end``, the first steps left out; validation is never inside a step), the bytes per step (the
strategy's exact ``byte_totals`` after fit / steps), per boundary and direction (``clapping/b{m}_fwd_bytes`` etc.:
the strategy gathers them asynchronously and logs the values of step t at step t + 1, none at the first step; each
rank's per-step record is re-aligned so that a row holds its own step's numbers, and the last step's are then only
in the totals), the veth and tbf counters (whole run, and per rank inside the training steps only), and the
validation loss every K steps on a fixed subset of the held-out plays. Time-to-target: the target is the validation
loss that uncompressed reaches at the end of its run on the same link; a run's time-to-target is its cumulative
training time (sum of step times, validation excluded) up to the first validation at or below the target, or "not
reached"; the report orders each link's variants by it ("first to the target"). ``--budget F`` lets the compressed
variants train up to F times the steps (default 1: the same steps for all).

Targets, on every 100 Mbit/s link: clapping-fc's step <= 1.15 x the loopback step, its time-to-target >= 2 x shorter
than uncompressed, and, on a link with delay, its step <= 1.25 x the delay floor (the uncompressed step's ratio to
that floor is reported next to it); on 25 Mbit/s links: time-to-target >= 4 x shorter.

Timings only mean something on an otherwise idle machine: every run records how many CPU cores other processes used
meanwhile (column "other"; the script warns when it exceeds 0.2), so disturbed numbers can be recognised and re-run.
On a delayed link the relay is the benchmark's own process: its CPU time during the run is left out of "other" and
recorded as ``relay_cores`` (``other_cores_with_relay`` keeps the sum).

Modes: ``--tiny`` (2 stages, a tiny model, 3 steps, one link: a smoke test, a few minutes), ``--quick`` (60 steps;
with 4 ranks on 2 cores each run takes 40-180 s, process start-up included: all 26 runs over ``--links 100@0 100@25
25@25`` took 36 minutes; leave rows out with ``--no-direct``, ``--no-aqsgd``, ``--no-auto``, ``--fc-extra`` and
``--fu-p`` without values), default (400 steps). ``--schedule gpipe`` runs every setting with GPipe instead of 1F1B.
``--loopback-only`` runs every variant on loopback and no shaped link (``benchmarks/time_to_target.py`` takes the loss
trajectories from it). A run with autotune records what it chose per boundary (``autotune_choice``).

Results: ``STEM.json`` (everything, per step), ``.csv`` (one row per run) and ``.png`` under ``--out``, STEM being
``--stem`` or ``slow_network`` + ``_delay`` (a link with delay) + ``_quick`` (quick mode), so quick and delayed runs do
not overwrite the full run's files; ``--validate-only`` writes ``slow_network_links.json`` (under ``--out``, default a
temp folder).
"""

from __future__ import annotations

import argparse
import atexit
import csv
import functools
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _netns import Endpoint, Lab, NetnsError, delay_unavailable_reason, unavailable_reason  # noqa: E402

MiB = 1 << 20


# ====================================================================================================================
# What to run
# ====================================================================================================================


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


def endpoint_sites(sites: tuple[int, ...] | None) -> list[int] | None:
    """The sites in the order of the stage endpoints: endpoint (and global rank) ``i`` runs stage ``S - 1 - i``
    (rank 0 holds the last stage), so the per-stage list is reversed."""
    return None if sites is None else list(reversed(sites))


def probe_pairs(sites: tuple[int, ...] | None, n: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """Endpoint indices to measure a link between: (a pair that crosses the slow link, a pair within one site or
    None). Without sites: endpoints 0 and 1, no same-site pair. With sites: neighbouring stages, so the cross-site
    pair is a real pipeline boundary."""
    if sites is None:
        return (0, 1), None
    order = endpoint_sites(sites)
    cross = next((i, i + 1) for i in range(n - 1) if order[i] != order[i + 1])
    same = next(((i, i + 1) for i in range(n - 1) if order[i] == order[i + 1]), None)
    return cross, same


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


def check_variant_codecs(variants: list["Variant"], boundaries: int) -> None:
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
    label: str
    variant: str
    p: float = 1.0  # lazy sampling: probability of a fresh batch (1.0: plain data module, except for aqsgd)
    forward_codec: str = "q4"
    backward_codec: str = "q8"
    autotune: bool = False  # ClappingStrategy(autotune=True): the strategy picks each boundary's codecs itself
    schedule: str | None = None  # this row's own schedule ("auto": autotune may switch); None: the run's --schedule
    fresh_codec: str | None = None  # ClappingStrategy(fresh_codec=...): the codec of fresh steps (None: as without)

    @property
    def sample_ids(self) -> bool:
        """AQ-SGD keeps one buffer per training sample: its data is wrapped in LazySamplingDataModule(p=1), which
        changes nothing but reports the sample ids."""
        return self.variant == "aqsgd"


@dataclass
class Mode:
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


# ====================================================================================================================
# Worker: one rank, started inside its namespace
# ====================================================================================================================


def _read_counters(ifname: str) -> tuple[int, int]:
    base = Path("/sys/class/net") / ifname / "statistics"
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return 0, 0


#: the strategy's per-step byte numbers (``clapping/...``): gathered asynchronously, logged one step late
LAGGED_PREFIX = "clapping/"


def metrics_lag(steps: list[dict]) -> int:
    """1 when the ``clapping/...`` values read at step t describe step t - 1 (the strategy logs none at the first
    step and gathers its byte numbers off the critical path), 0 for a strategy that logs each step's own."""
    if not steps or any(k.startswith(LAGGED_PREFIX) for k in steps[0]):
        return 0
    return 1 if any(k.startswith(LAGGED_PREFIX) for s in steps[1:] for k in s) else 0


def align_step_metrics(steps: list[dict], lag: int) -> list[dict]:
    """Each step's row with the ``clapping/...`` values of that step: with ``lag`` 1 they are taken from the next
    row (where they were logged); the last step then has none (its numbers are only in ``byte_totals``). Timings,
    interface counters and the other metrics (``train_loss`` is the step's own) stay in their row."""
    if lag == 0:
        return [dict(s) for s in steps]
    out = []
    for i, s in enumerate(steps):
        row = {k: x for k, x in s.items() if not k.startswith(LAGGED_PREFIX)}
        if i + lag < len(steps):
            row.update((k, x) for k, x in steps[i + lag].items() if k.startswith(LAGGED_PREFIX))
        out.append(row)
    return out


def autotune_choice(choices: dict | None) -> dict[str, dict[str, str]] | None:
    """What autotune picked (the strategy's ``_autotuned``: boundary -> Choice), as JSON: ``{"0": {"fwd": "q4",
    "bwd": "uncompressed"}, ...}``. A run's loss trajectory depends on it, so it is recorded with the run."""
    if not choices:
        return None
    return {str(b): {d: c.setting(d) for d in ("fwd", "bwd")} for b, c in sorted(choices.items())}


def worker(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    threads = int(cfg["threads"])
    import torch

    torch.set_num_threads(threads)
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    sys.path.insert(0, str(ROOT / "examples"))
    from char_lm import CharTransformer
    from datasets import ShakespeareDataModule

    import lightning_clapping
    from datetime import timedelta

    from lightning_clapping.codecs import get_codec

    rank = int(os.environ["NODE_RANK"])
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    stages = cfg["stages"]
    metric_names = ["clapping/bytes", "clapping/ratio", "clapping/fresh", "clapping/distinct_samples", "train_loss"]
    metric_names += [f"clapping/b{m}_{d}_bytes" for m in range(stages - 1) for d in ("fwd", "bwd")]

    class Recorder(Callback):
        """Wall time and interface counters of every training step and validation (every rank keeps its own)."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.vals: list[dict] = []
            self.train_tx = self.train_rx = self.val_tx = self.val_rx = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._c0 = _read_counters(ifname)
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seconds = time.perf_counter() - self._t0
            tx, rx = _read_counters(ifname)
            row = {"step": trainer.global_step, "seconds": seconds, "tx": tx - self._c0[0], "rx": rx - self._c0[1]}
            self.train_tx += row["tx"]
            self.train_rx += row["rx"]
            metrics = trainer.callback_metrics
            for name in metric_names:
                if name in metrics:
                    row[name] = float(metrics[name])
            self.steps.append(row)

        def on_validation_start(self, trainer, pl_module):
            self._v0 = _read_counters(ifname)
            self._vt0 = time.perf_counter()

        def on_validation_end(self, trainer, pl_module):
            tx, rx = _read_counters(ifname)
            self.val_tx += tx - self._v0[0]
            self.val_rx += rx - self._v0[1]
            if trainer.sanity_checking:
                return
            val = trainer.callback_metrics.get("val_loss")
            self.vals.append({"step": trainer.global_step, "val_loss": None if val is None else float(val),
                              "seconds": time.perf_counter() - self._vt0})

    t_start = time.perf_counter()
    L.seed_everything(cfg["seed"], verbose=False)
    dm = ShakespeareDataModule(batch_size=cfg["batch"], seed=cfg["seed"], block_size=cfg["block"],
                               limit=cfg["data_limit"])
    dm.setup("fit")
    model = CharTransformer(dm.vocab_size, block_size=cfg["block"], d=cfg["d"], heads=cfg["heads"],
                            layers=cfg["layers"])
    v = cfg["variant"]
    # lazy sampling for p < 1; AQ-SGD needs the sample ids that the wrapper reports (at p = 1 it changes nothing else)
    wrap = v["p"] < 1.0 or v["variant"] == "aqsgd"
    data = lightning_clapping.LazySamplingDataModule(dm, p=v["p"], seed=cfg["seed"]) if wrap else dm
    extra = {"autotune": True} if v.get("autotune") else {}  # only then: older strategies lack the keyword
    if v.get("fresh_codec"):
        extra["fresh_codec"] = v["fresh_codec"]
    strategy = lightning_clapping.ClappingStrategy(
        split_points=[f"blocks.{i}" for i in cfg["cuts"]], microbatches=cfg["microbatches"],
        schedule=v.get("schedule") or cfg["schedule"], variant=v["variant"],
        forward_codec=codec_arg(v["forward_codec"], stages - 1, get_codec),
        backward_codec=codec_arg(v["backward_codec"], stages - 1, get_codec),
        timeout=timedelta(seconds=cfg["strategy_timeout"]), **extra)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=stages, strategy=strategy, max_steps=cfg["steps"],
        val_check_interval=cfg["val_every"], check_val_every_n_epoch=None, limit_val_batches=cfg["val_batches"],
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, callbacks=[recorder])
    assert trainer.global_rank == rank and trainer.strategy.num_stages == stages, (trainer.global_rank, stages)
    t_fit = time.perf_counter()
    trainer.fit(model, datamodule=data)
    lag = metrics_lag(recorder.steps)
    totals = getattr(trainer.strategy, "byte_totals", None)
    result = {
        "rank": rank, "stage": stages - 1 - rank, "ifname": ifname, "steps": align_step_metrics(recorder.steps, lag),
        "metrics_lag": lag, "byte_totals": dict(totals) if totals else None, "vals": recorder.vals,
        "autotune": {k: float(x) for k, x in trainer.callback_metrics.items() if k.startswith("autotune/")},
        "autotune_choice": autotune_choice(getattr(strategy, "_autotuned", None)),
        "schedule": getattr(strategy, "schedule", None),
        "train_tx": recorder.train_tx, "train_rx": recorder.train_rx, "val_tx": recorder.val_tx,
        "val_rx": recorder.val_rx, "setup_seconds": t_fit - t_start, "fit_seconds": time.perf_counter() - t_fit,
        "torch_threads": torch.get_num_threads(),
        "cluster_environment": type(strategy.cluster_environment).__name__,
    }
    Path(cfg["result_dir"], f"rank{rank}.json").write_text(json.dumps(result))
    # leave together: a rank that exits while a peer still talks to it can make the peer's gloo threads abort
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ====================================================================================================================
# Launcher: namespaces, processes, clean-up
# ====================================================================================================================


class Runner:
    """Owns the lab and the live worker processes; ``close()`` (idempotent) kills the workers and tears down."""

    def __init__(self, lab: Lab, workdir: Path) -> None:
        self.lab, self.workdir = lab, workdir
        self.procs: list[subprocess.Popen] = []
        self.port = 29500

    def _kill_workers(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: only what this script started
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def close(self) -> None:
        self._kill_workers()
        self.lab.teardown()

    def run(self, key: str, cfg: dict, endpoints: list[Endpoint], timeout: float) -> dict:
        run_dir = self.workdir / key
        run_dir.mkdir(parents=True)
        cfg = dict(cfg, result_dir=str(run_dir))
        cfg_path = run_dir / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        self.port += 1  # a fresh port per run: no lingering socket of the previous run in the way
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_")) and k not in ("RANK", "GROUP_RANK")}
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p),
            OMP_NUM_THREADS=str(cfg["threads"]), MKL_NUM_THREADS=str(cfg["threads"]),
            MASTER_ADDR=endpoints[0].addr, MASTER_PORT=str(self.port), WORLD_SIZE=str(len(endpoints)),
            LOCAL_RANK="0", HF_HUB_OFFLINE="1",
        )
        logs = []
        for rank, ep in enumerate(endpoints):  # rank 0 first: it hosts the rendezvous store
            log = open(run_dir / f"rank{rank}.log", "w")
            logs.append(log)
            self.procs.append(subprocess.Popen(
                self.lab.command(ep, [sys.executable, str(Path(__file__).resolve()), "--worker", str(cfg_path)]),
                env=dict(env, NODE_RANK=str(rank), GLOO_SOCKET_IFNAME=ep.ifname), stdout=log,
                stderr=subprocess.STDOUT, cwd=str(run_dir), start_new_session=True, preexec_fn=_die_with_parent))
        t0, error = time.monotonic(), None
        busy0, mine0 = _cpu_busy_seconds(), _children_cpu_seconds()
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    error = f"rank {bad[0][0]} exited with {bad[0][1]}"
                    deadline = time.monotonic() + 10  # the others may still be writing their results
                    try:
                        for proc in self.procs:
                            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() - t0 > timeout:
                    error = f"timed out after {timeout:.0f} s"
                    break
                time.sleep(0.2)
        finally:
            self._kill_workers()
            for log in logs:
                log.close()
        wall = time.monotonic() - t0
        # CPU time the rest of the machine used meanwhile (all CPU time minus this run's ranks), in cores: timings
        # taken while other jobs compete for a small CPU are slower, and this says by how much the CPU was shared
        other_cores = max(0.0, (_cpu_busy_seconds() - busy0) - (_children_cpu_seconds() - mine0)) / max(wall, 1e-9)
        warning = None
        results = [run_dir / f"rank{r}.json" for r in range(len(endpoints))]
        if error is not None and error.startswith("rank") and all(f.exists() for f in results):
            # every rank finished its measurements and wrote them; one failed on the way out: keep the numbers, say so
            error, warning = None, f"{error} after writing its results"
        if error is None:
            try:
                ranks = [json.loads(f.read_text()) for f in results]
            except (OSError, ValueError) as err:
                error, ranks = f"missing worker results: {err}", []
        if error is not None:
            tails = []
            for r in range(len(endpoints)):
                text = (run_dir / f"rank{r}.log").read_text(errors="replace")
                tails.append(f"--- rank {r} (last lines) ---\n" + "\n".join(text.splitlines()[-25:]))
            return {"error": error, "wall_seconds": wall, "other_cores": other_cores, "log_tail": "\n".join(tails)}
        return {"error": None, "warning": warning, "wall_seconds": wall, "other_cores": other_cores, "ranks": ranks}


def _cpu_busy_seconds() -> float:
    """Busy CPU time of the whole machine since boot (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the launching process dies, so no rank outlives the benchmark."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _raise_on_signal(signum, frame):
    raise SystemExit(128 + signum)


# ====================================================================================================================
# Analysis and report
# ====================================================================================================================


def summarize(raw: dict, mode: Mode, link: LinkSpec | None, variant: Variant, counters: dict | None) -> dict:
    """One run's numbers from the workers' records (rank 0 holds the last stage and the logged metrics)."""
    row = {"link": "loopback" if link is None else link.label, "rate_mbit": None if link is None else link.rate_mbit,
           "delay_ms": None if link is None else link.delay_ms, "link_kind": "loopback" if link is None else link.kind,
           "sites": None if link is None or link.sites is None else list(link.sites),
           "variant": variant.label, "kind": variant.variant, "p": variant.p, "error": raw.get("error"),
           "wall_seconds": raw["wall_seconds"], "other_cores": raw.get("other_cores"), "warning": raw.get("warning")}
    if raw.get("error"):
        return row
    S = mode.stages
    r0 = next(r for r in raw["ranks"] if r["rank"] == 0)
    steps = r0["steps"]
    times = [s["seconds"] for s in steps]
    timed = times[mode.skip:] or times
    cumulative, total = {}, 0.0
    for s in steps:
        total += s["seconds"]
        cumulative[s["step"]] = total

    def med(name: str) -> float | None:
        values = [s[name] for s in steps if name in s]
        return statistics.median(values) if values else None

    fp32 = fp32_message_bytes(mode)
    # exact sums over all steps (the last one included) when the strategy has them; else the mean of the logged steps
    totals = r0.get("byte_totals") or {}
    if totals.get("steps"):
        bytes_per_step = totals["bytes"] / totals["steps"]
    else:
        bytes_per_step = _mean([s.get("clapping/bytes") for s in steps])
    row.update(
        steps=len(steps), median_step_s=statistics.median(timed), mean_step_s=statistics.fmean(timed),
        p10_step_s=_quantile(timed, 0.1), p90_step_s=_quantile(timed, 0.9), first_step_s=times[0],
        train_seconds=total, bytes_per_step=bytes_per_step, byte_totals=totals or None,
        metrics_lag=r0.get("metrics_lag", 0), autotune=r0.get("autotune") or None,
        autotune_choice=r0.get("autotune_choice"), schedule=r0.get("schedule"),
        median_bytes_per_step=med("clapping/bytes"),
        fp32_bytes_per_step=2 * (S - 1) * fp32, logged_ratio=med("clapping/ratio"),
        fwd_bytes_per_boundary=[_mean([s.get(f"clapping/b{m}_fwd_bytes") for s in steps]) for m in range(S - 1)],
        bwd_bytes_per_boundary=[_mean([s.get(f"clapping/b{m}_bwd_bytes") for s in steps]) for m in range(S - 1)],
        min_message_bytes=min((s.get(f"clapping/b{m}_{d}_bytes") or math.inf for s in steps for m in range(S - 1)
                               for d in ("fwd", "bwd")), default=0.0) / mode.microbatches,
        # samples of fresh batches (all batches without lazy sampling); the logged count of the last step is gone
        distinct_samples=(totals["fresh_steps"] * mode.batch if totals.get("steps")
                          else steps[-1].get("clapping/distinct_samples", len(steps) * mode.batch)),
        final_train_loss=steps[-1].get("train_loss"),
        vals=[dict(v, train_seconds=cumulative.get(v["step"])) for v in r0["vals"]],
        setup_seconds=max(r["setup_seconds"] for r in raw["ranks"]),
        step_times=times,
        bytes_per_step_series=[s.get("clapping/bytes") for s in steps],
    )
    row["final_val_loss"] = row["vals"][-1]["val_loss"] if row["vals"] else None
    row["fewer_bytes_x"] = row["fp32_bytes_per_step"] / row["bytes_per_step"] if row["bytes_per_step"] else None
    # per rank: what the strategy says it sent in the training steps, against what left its interface meanwhile;
    # both over the steps whose per-boundary numbers are known (with the logged numbers a step late: all but the last)
    known = {s["step"] for s in steps if "clapping/bytes" in s}
    per_rank = []
    for r in sorted(raw["ranks"], key=lambda r: r["rank"]):
        stage = S - 1 - r["rank"]
        sent = 0.0
        for s in steps:
            if stage < S - 1:
                sent += s.get(f"clapping/b{stage}_fwd_bytes", 0.0)
            if stage > 0:
                sent += s.get(f"clapping/b{stage - 1}_bwd_bytes", 0.0)
        entry = {"rank": r["rank"], "stage": stage, "ifname": r["ifname"], "strategy_sent_bytes": sent}
        if link is not None:  # on loopback every rank shares `lo`: its counters say nothing per rank
            tx_known = sum(s["tx"] for s in r["steps"] if s["step"] in known)
            entry.update(veth_tx_in_steps=r["train_tx"], veth_rx_in_steps=r["train_rx"],
                         veth_tx_in_validation=r["val_tx"], veth_tx_in_known_steps=tx_known,
                         veth_over_strategy=tx_known / sent if sent else None)
        per_rank.append(entry)
    row["per_rank"] = per_rank
    if link is not None:
        row["counters_whole_run"] = counters
        busiest = max(per_rank, key=lambda e: e["veth_tx_in_steps"])
        # the wire time of the busiest interface alone, per step: a floor under the step time at this rate
        row["wire_floor_step_s"] = busiest["veth_tx_in_steps"] * 8 / (link.rate_mbit * 1e6) / len(steps)
        row["veth_over_strategy"] = (sum(e["veth_tx_in_known_steps"] for e in per_rank)
                                     / max(1.0, sum(e["strategy_sent_bytes"] for e in per_rank)))
        if counters:
            row["tbf_overlimits"] = sum(c.get("qdisc_overlimits", 0) for c in counters.values())
            row["tbf_drops"] = sum(c.get("qdisc_drops", 0) for c in counters.values())
            if link.delay_ms is not None:
                row["relay_queue_drops"] = sum(c.get("relay_queue_drops", 0) for c in counters.values())
                row["relay_wire_bytes"] = sum(c.get("relay_wire_bytes", 0) for c in counters.values())
    return row


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def time_to_target(row: dict, target: float | None) -> tuple[float | None, int | None]:
    if target is None or row.get("error"):
        return None, None
    for v in row["vals"]:
        if v["val_loss"] is not None and v["val_loss"] <= target:
            return v["train_seconds"], v["step"]
    return None, None


def add_comparisons(rows: list[dict]) -> None:
    """Ratios measured side by side: step time over the loopback step time, time-to-target against uncompressed."""
    loop = next((r for r in rows if r["rate_mbit"] is None and r["kind"] == "uncompressed" and not r["error"]), None)
    for r in rows:
        if r["error"]:
            continue
        r["x_loopback_step"] = r["median_step_s"] / loop["median_step_s"] if loop else None
        base = next((b for b in rows if b["link"] == r["link"] and b["kind"] == "uncompressed" and not b["error"]),
                    None)
        r["target_val_loss"] = base["final_val_loss"] if base else None
        r["time_to_target_s"], r["target_step"] = time_to_target(r, r["target_val_loss"])
        base_ttt = time_to_target(base, r["target_val_loss"])[0] if base else None
        r["ttt_speedup"] = (base_ttt / r["time_to_target_s"]) if base_ttt and r["time_to_target_s"] else None
        r["step_speedup"] = base["median_step_s"] / r["median_step_s"] if base else None
        r["mean_step_speedup"] = base["mean_step_s"] / r["mean_step_s"] if base else None
        if r.get("delay_ms") is not None and loop:
            # fill and drain: every step waits at least once for each boundary forward and once backward (with
            # sites: each boundary between two sites; within a site there is no delay)
            sites = r.get("sites") or range(len(r["per_rank"]))
            slow = sum(x != y for x, y in zip(sites, sites[1:]))
            r["delay_floor_step_s"] = loop["median_step_s"] + 2 * slow * r["delay_ms"] / 1000
            r["x_delay_floor"] = r["median_step_s"] / r["delay_floor_step_s"]


#: on a delayed 100 Mbit/s link, clapping-fc's step may be at most this many times the delay floor
DELAY_FLOOR_BOUND = 1.25


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """The project's targets on every link of rate 100 or 25 Mbit/s (each delay its own link, named by its label)."""

    def find(link, kind):
        return next((r for r in rows if r["link"] == link and r["kind"] == kind and not r["error"]), None)

    def fc_specs(rate: float, link: str, row: dict | None, name: str, delayed: bool) -> list[tuple]:
        if rate == 100.0:
            specs = [(f"{link}: {name} step time <= 1.15x loopback step time", row, "x_loopback_step", 1.15, "<="),
                     (f"{link}: {name} time-to-target >= 2x shorter than uncompressed", row, "ttt_speedup", 2.0,
                      ">=")]
            if delayed:  # the physical limit of a synchronous pipeline on a link with delay
                specs.append((f"{link}: {name} step time <= {DELAY_FLOOR_BOUND:g}x the delay floor (loopback step "
                              "+ 2 x (stages - 1) x one-way delay)", row, "x_delay_floor", DELAY_FLOOR_BOUND, "<="))
            return specs
        return [(f"{link}: {name} time-to-target >= 4x shorter than uncompressed", row, "ttt_speedup", 4.0, ">=")]

    out, specs = [], []
    for rate in (100.0, 25.0):
        links = list(dict.fromkeys(r["link"] for r in rows if r["rate_mbit"] == rate)) or [f"{rate:g} Mbit/s"]
        for link in links:
            delayed = any((r.get("delay_ms") or 0) > 0 for r in rows if r["link"] == link)
            # the first clapping-fc run of a link is the main one; the others (--fc-extra, auto) are named by their
            # label
            main = find(link, "clapping-fc")
            specs += fc_specs(rate, link, main, "clapping-fc", delayed)
            for extra in (r for r in rows if r["link"] == link and r["kind"] == "clapping-fc" and not r["error"]
                          and r is not main):
                specs += fc_specs(rate, link, extra, extra["variant"], delayed)
            if delayed and rate == 100.0:  # how far uncompressed is from the same limit: to read, not a target
                specs.append((f"{link}: uncompressed step time / delay floor", find(link, "uncompressed"),
                              "x_delay_floor", None, "report"))
    for text, row, key, bound, op in specs:
        value = row.get(key) if row else None
        if row is None:
            verdict = "not measured (link not in this run or the run failed)"
        elif value is None:
            verdict = "NOT MET (target loss not reached)" if key == "ttt_speedup" else "not measured"
        elif op == "report":
            verdict = "reported (not a target)"
        else:
            ok = value <= bound if op == "<=" else value >= bound
            verdict = "MET" if ok else "NOT MET"
        out.append({"target": text, "value": value, "bound": bound, "verdict": verdict})
    return out


def first_to_target(rows: list[dict]) -> dict[str, list[dict]]:
    """Per shaped link, every variant ordered by its time to the link's target (training time, validation excluded;
    those that did not reach it last, by their final validation loss): which setting gets there first."""
    out: dict[str, list[dict]] = {}
    for link in dict.fromkeys(r["link"] for r in rows if r["rate_mbit"] is not None):
        mine = [r for r in rows if r["link"] == link and not r["error"]]
        ranked = sorted(mine, key=lambda r: (r.get("time_to_target_s") is None, r.get("time_to_target_s") or 0.0,
                                             r.get("final_val_loss") if r.get("final_val_loss") is not None
                                             else math.inf))
        out[link] = [{"variant": r["variant"], "time_to_target_s": r.get("time_to_target_s"),
                      "target_step": r.get("target_step"), "final_val_loss": r.get("final_val_loss"),
                      "median_step_s": r["median_step_s"]} for r in ranked]
    return out


def _fmt(x, spec=".3f", none="-") -> str:
    return none if x is None else format(x, spec)


TABLE_LEGEND = (
    "step s / mean s: median / mean wall time of a training step on rank 0 (first steps left out); x loop: / the "
    "loopback uncompressed step time; x unc (first): uncompressed step time / this one, same link; MiB/step: bytes "
    "the strategy sent over all boundaries per step (its exact totals / steps: headers and the step results that "
    "ride on the gradient messages included); fewer: fp32 bytes / those bytes; veth/str: bytes that left the stage "
    "interfaces during training steps / bytes the strategy counted, over the steps whose per-boundary numbers are "
    "known (all but the last: they are logged a step late; TCP/IP headers, ACKs and the asynchronous gather of the "
    "byte numbers make it > 1); floor s: busiest interface's bytes per step / link rate; x floor: step / delay floor "
    "(loopback step + 2 x (stages - 1) x one-way delay, delayed links only); val loss: at the last "
    "step; target: uncompressed final val loss on that link; to target s: cumulative training time to the first "
    "validation <= target (@ step); x unc (last): uncompressed time-to-target / this one; other: CPU cores that "
    "other processes on the machine used on average during the run (> 0 means the timings were disturbed)."
)


def print_table(rows: list[dict]) -> None:
    head = (f"{'link':<16} {'variant':<24} {'step s':>7} {'mean s':>7} {'x loop':>7} {'x unc':>6} {'x floor':>7} "
            f"{'MiB/step':>8} {'fewer':>6} {'veth/str':>8} {'floor s':>7} {'val loss':>8} {'target':>7} "
            f"{'to target s':>11} {'x unc':>6} {'other':>5}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["error"]:
            print(f"{r['link']:<16} {r['variant']:<24} FAILED: {r['error']}")
            continue
        ttt = (f"{r['time_to_target_s']:.1f} @{r['target_step']}" if r.get("time_to_target_s") is not None
               else "not reached")
        mib = r["bytes_per_step"] / MiB if r["bytes_per_step"] is not None else None
        print(f"{r['link']:<16} {r['variant']:<24} {r['median_step_s']:>7.3f} {r['mean_step_s']:>7.3f} "
              f"{_fmt(r.get('x_loopback_step'), '.2f'):>7} {_fmt(r.get('step_speedup'), '.2f'):>6} "
              f"{_fmt(r.get('x_delay_floor'), '.2f'):>7} {_fmt(mib, '.3f'):>8} "
              f"{_fmt(r.get('fewer_bytes_x'), '.1f'):>6} "
              f"{_fmt(r.get('veth_over_strategy'), '.3f'):>8} "
              f"{_fmt(r.get('wire_floor_step_s'), '.3f'):>7} {_fmt(r['final_val_loss'], '.4f'):>8} "
              f"{_fmt(r.get('target_val_loss'), '.4f'):>7} {ttt:>11} {_fmt(r.get('ttt_speedup'), '.2f'):>6} "
              f"{_fmt(r.get('other_cores'), '.2f'):>5}")
    print()
    print(textwrap.fill(TABLE_LEGEND, width=118))


# ====================================================================================================================
# Links: set up, and checked against their configuration
# ====================================================================================================================

# what TCP can carry at most: 1448 payload bytes (MSS with timestamps) per 1500-byte IP packet; tbf also counts the
# 14-byte Ethernet header of each frame on a veth, the relay counts IP bytes
PAYLOAD_SHARE = {"veth+tbf": 1448 / 1514, "tun+relay": 1448 / 1500}
RTT_SLACK_MS = 15.0  # a check passes with the RTT median in [2 x delay, 2 x delay + this] and the throughputs in:
THROUGHPUT_BOUNDS = (0.6, 1.1)  # x the configured rate
MEASURED = ("rtt_ms_min", "rtt_ms_median", "rtt_ms_max", "rtt_samples", "ping_lost", "owd_ms_there", "owd_ms_back",
            "owd_ms_there_min", "owd_ms_back_min", "tcp_connect_ms", "congestion_control", "bytes", "seconds",
            "mbit_s", "steady_mbit_s")  # what _delay_link.measure returns


def shaping_text(link: LinkSpec, args: argparse.Namespace) -> str:
    if link.delay_ms is None:
        return f"veth, tbf burst {args.burst} latency {args.latency}"
    text = f"TUN + relay, per-sender rate without burst, queue {_ms(args.latency):g} ms, delay {link.delay_ms:g} ms"
    if link.sites is not None:
        text += f"; between sites only (sites {','.join(map(str, link.sites))}; within a site: no limit, no delay)"
    return text


def configure_link(lab: Lab, link: LinkSpec, args: argparse.Namespace, stage_eps: list[Endpoint],
                   delay_eps: list[Endpoint]) -> list[Endpoint]:
    """Make every stage link ``link`` (reshape the veths, or restart the relay); returns the endpoints to use."""
    if link.delay_ms is None:
        lab.shape(link.rate_mbit, args.burst, args.latency)
        return stage_eps
    lab.set_delay_links(link.rate_mbit, link.delay_ms, _ms(args.latency), sites=endpoint_sites(link.sites))
    return delay_eps


def relay_summary(stats: dict | None) -> dict | None:
    """The relay's counters over all stage links: what it carried, dropped, and how late it delivered."""
    if not stats:
        return None
    ports = stats["ports"]

    def worst(key):
        values = [p[key] for p in ports if p[key] is not None]
        return max(values) if values else None

    return {"uptime_s": stats["uptime_s"], "cpu_s": stats["cpu_s"],
            "packets": sum(p["rx_packets"] for p in ports), "frames": sum(p["frames"] for p in ports),
            "wire_bytes": sum(p["wire_bytes"] for p in ports), "queue_drops": sum(p["queue_drops"] for p in ports),
            "lan_packets": sum(p["lan_packets"] for p in ports), "lan_bytes": sum(p["lan_bytes"] for p in ports),
            "unroutable": sum(p["unroutable"] for p in ports), "write_errors": sum(p["write_errors"] for p in ports),
            "late_ms_p50_worst_link": worst("late_ms_p50"), "late_ms_p99_worst_link": worst("late_ms_p99"),
            "late_ms_max": worst("late_ms_max"), "max_queue_ms": max(p["max_queue_us"] for p in ports) / 1000}


def _measure_pair(lab: Lab, src: Endpoint, dst: Endpoint) -> dict:
    """``Lab.measure`` (20 pings, 2 s of TCP); a failure is recorded under ``error``, every number then None."""
    try:
        return lab.measure(src, dst, pings=20, seconds=2.0)
    except NetnsError as err:  # recorded and printed; the runs on this link still go ahead
        return dict(dict.fromkeys(MEASURED, None), error=str(err))


def check_link(lab: Lab, link: LinkSpec, endpoints: list[Endpoint], args: argparse.Namespace) -> dict:
    """What the configured link really does between two stage namespaces (the first two; with sites, two
    neighbouring stages in different sites): round-trip time of a UDP echo (expect 2 x delay) and the throughput of a
    2-second TCP transfer (expect the rate, less the header share). With sites, a pair of neighbouring stages in one
    site is measured too (``same_site``: expect no delay and no rate limit)."""
    (a, b), same = probe_pairs(link.sites, len(endpoints))
    m = _measure_pair(lab, endpoints[a], endpoints[b])
    expect = 2 * (link.delay_ms or 0.0)
    last = len(endpoints) - 1  # endpoint i runs stage last - i
    rec = {"link": link.label, "rate_mbit": link.rate_mbit, "delay_ms": link.delay_ms, "link_kind": link.kind,
           "sites": None if link.sites is None else list(link.sites),
           "shaping": shaping_text(link, args), "from": endpoints[a].addr, "to": endpoints[b].addr,
           "from_stage": last - a, "to_stage": last - b,
           "expected_rtt_ms": expect, "payload_ceiling_mbit_s": link.rate_mbit * PAYLOAD_SHARE[link.kind], **m}
    rec["throughput_ratio"] = m["steady_mbit_s"] / link.rate_mbit if m["steady_mbit_s"] else None
    rec["throughput_ratio_whole"] = m["mbit_s"] / link.rate_mbit if m["mbit_s"] else None
    problems = [f"measurement failed: {m['error']}"] if m.get("error") else []
    if m["rtt_ms_median"] is None or not expect <= m["rtt_ms_median"] <= expect + RTT_SLACK_MS:
        problems.append(f"RTT median {_fmt(m['rtt_ms_median'], '.2f')} ms not in [{expect:g}, "
                        f"{expect + RTT_SLACK_MS:g}]")
    if m["rtt_ms_min"] is not None and m["rtt_ms_min"] < expect:
        problems.append(f"a round trip ({m['rtt_ms_min']:.2f} ms) was shorter than 2 x delay")
    for way in ("there", "back"):
        low = m[f"owd_ms_{way}_min"]
        if low is not None and low < (link.delay_ms or 0.0):
            problems.append(f"a packet arrived {way} after {low:.2f} ms, before the one-way delay")
    lo, hi = THROUGHPUT_BOUNDS
    for key in ("throughput_ratio", "throughput_ratio_whole"):
        if rec[key] is None or not lo <= rec[key] <= hi:
            problems.append(f"{key} {_fmt(rec[key], '.2f')} not in [{lo}, {hi}]")
    rec["same_site"] = None
    if same is not None:
        rec["same_site"] = dict(_measure_pair(lab, endpoints[same[0]], endpoints[same[1]]), from_stage=last - same[0],
                                to_stage=last - same[1], **{"from": endpoints[same[0]].addr,
                                                            "to": endpoints[same[1]].addr})
        problems += same_site_problems(rec["same_site"])
    rec["problems"] = problems
    rec["verdict"] = "ok" if not problems else "FAILED" if m.get("error") else "OFF"
    rec["relay"] = relay_summary(lab.relay_stats()) if link.delay_ms is not None else None
    return rec


def same_site_problems(m: dict) -> list[str]:
    """Within a site packets pass at once: a round trip there must stay under the slack allowed for scheduling."""
    if m.get("error"):
        return [f"same-site measurement failed: {m['error']}"]
    if m["rtt_ms_median"] is None or m["rtt_ms_median"] > RTT_SLACK_MS:
        return [f"same-site RTT median {_fmt(m['rtt_ms_median'], '.2f')} ms, not under {RTT_SLACK_MS:g} ms: the "
                "site's LAN is not fast"]
    return []


LINK_LEGEND = (
    "RTT: UDP echo of 64 bytes between stage namespaces 0 and 1, 20 samples one at a time (min/median/max); expect: "
    "2 x one-way delay; one-way: median delay there (0 -> 1) / back, ms, from the clock all namespaces share; TCP: "
    "payload received per second in a 2-second transfer (bulk: median of 100 ms intervals in its "
    "second half, whole: from accept to the last byte, TCP start-up included); /rate: bulk / configured rate (TCP "
    f"payload is at most 1448/1500 of it, 1448/1514 on tbf, which counts Ethernet headers); ok: RTT median in [expect, "
    f"expect + {RTT_SLACK_MS:g} ms], no round trip under expect and no packet faster than the delay, both rates in "
    f"{list(THROUGHPUT_BOUNDS)} x rate; drops, "
    "late: the relay's queue drops and how late it delivered (p99 of the worst link, ms) during the check."
)


def print_link_checks(checks: list[dict]) -> None:
    head = (f"{'link':<16} {'kind':<9} {'RTT ms min/med/max':>22} {'expect':>6} {'one-way':>11} {'TCP bulk':>8} "
            f"{'whole':>6} {'/rate':>5} {'ok':>6} {'drops':>5} {'late':>5}")
    print(head)
    print("-" * len(head))
    for c in checks:
        relay = c.get("relay") or {}
        rtt = "/".join(_fmt(c[k], ".2f") for k in ("rtt_ms_min", "rtt_ms_median", "rtt_ms_max"))
        one_way = f"{_fmt(c['owd_ms_there'], '.1f')}/{_fmt(c['owd_ms_back'], '.1f')}"
        print(f"{c['link']:<16} {c['link_kind']:<9} {rtt:>22} {c['expected_rtt_ms']:>6.0f} {one_way:>11} "
              f"{_fmt(c['steady_mbit_s'], '.1f'):>8} {_fmt(c['mbit_s'], '.1f'):>6} "
              f"{_fmt(c['throughput_ratio'], '.2f'):>5} {c['verdict']:>6} "
              f"{_fmt(relay.get('queue_drops'), 'd'):>5} {_fmt(relay.get('late_ms_p99_worst_link'), '.2f'):>5}")
    for c in checks:
        if c.get("sites") is not None:
            print(f"  {c['link']}: measured across sites, stages {c['from_stage']} -> {c['to_stage']}"
                  + _same_site_text(c.get("same_site")))
        for problem in c["problems"]:
            print(f"  WARNING {c['link']}: {problem}")
    print(textwrap.fill(LINK_LEGEND, width=118))


def _same_site_text(m: dict | None) -> str:
    if m is None:
        return "; no two neighbouring stages share a site"
    rtt = "/".join(_fmt(m[k], ".2f") for k in ("rtt_ms_min", "rtt_ms_median", "rtt_ms_max"))
    return (f"; within a site, stages {m['from_stage']} -> {m['to_stage']}: RTT {rtt} ms, TCP bulk "
            f"{_fmt(m['steady_mbit_s'], '.1f')} Mbit/s, whole {_fmt(m['mbit_s'], '.1f')}")


def plot(rows: list[dict], links: list[LinkSpec], shaping: dict[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r["error"]]
    groups = ["loopback"] + [x.label for x in links]
    # the variants in the order of a shaped link's runs (loopback has only some), one colour each in every panel
    labels = list(dict.fromkeys([r["variant"] for r in ok if r["link"] != "loopback"]
                                + [r["variant"] for r in ok]))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {label: cycle[j % len(cycle)] for j, label in enumerate(labels)}
    fig, axes = plt.subplots(1, 1 + len(links), figsize=(5.5 * (1 + len(links)), 4.3), squeeze=False)
    axes = axes[0]  # one row; also an array with the loopback panel alone (--loopback-only)
    ax = axes[0]
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        xs, means, medians = [], [], []
        for g, name in enumerate(groups):
            r = next((r for r in ok if r["link"] == name and r["variant"] == label), None)
            if r is not None:
                xs.append(g + (j - (len(labels) - 1) / 2) * width)
                means.append(r["mean_step_s"])
                medians.append(r["median_step_s"])
        ax.bar(xs, means, width, label=label, color=colour[label])
        ax.plot(xs, medians, "k.", ms=5, label="median" if j == 0 else None)
    floor_label = "delay floor"
    for g, name in enumerate(groups):  # the delay floor of a delayed link, across its group of bars
        floor = next((r["delay_floor_step_s"] for r in ok if r["link"] == name and r.get("delay_floor_step_s")), None)
        if floor is not None:
            ax.hlines(floor, g - 0.45, g + 0.45, colors="red", linestyles="--", lw=1, label=floor_label)
            floor_label = None
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("step time (s): bar mean, dot median")
    ax.set_title("step time per link (rank 0, warm-up left out)")
    ax.legend(fontsize=8)
    for ax, link in zip(axes[1:], links):
        name = link.label
        target = None
        for r in ok:
            if r["link"] != name:
                continue
            target = r.get("target_val_loss", target)
            pts = [(v["train_seconds"], v["val_loss"]) for v in r["vals"] if v["val_loss"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=r["variant"], color=colour[r["variant"]])
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=1, label="target (uncompressed final)")
        ax.set_xlabel("training wall time (s, validation excluded)")
        ax.set_ylabel("validation loss")
        ax.set_title(textwrap.fill(f"{name}: {shaping[name]}", width=60), fontsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict:
    from importlib.metadata import version  # no torch import in the launcher: it only waits for the ranks

    from _machine import cpu_model

    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "torch": version("torch"),
            "lightning": version("lightning"), "python": platform.python_version(), "kernel": platform.release(),
            "load_average_at_start": list(os.getloadavg())}


CSV_FIELDS = [
    "link", "delay_ms", "link_kind", "variant", "kind", "p", "error", "steps", "median_step_s", "mean_step_s",
    "p10_step_s", "p90_step_s", "x_loopback_step", "step_speedup", "mean_step_speedup", "bytes_per_step",
    "median_bytes_per_step", "fp32_bytes_per_step", "fewer_bytes_x", "veth_over_strategy", "wire_floor_step_s",
    "delay_floor_step_s", "x_delay_floor", "tbf_overlimits", "tbf_drops", "relay_queue_drops", "final_val_loss",
    "target_val_loss", "time_to_target_s", "target_step", "ttt_speedup", "train_seconds", "distinct_samples",
    "other_cores", "relay_cores", "other_cores_with_relay", "load_before", "load_after", "wall_seconds", "warning",
]


# ====================================================================================================================
# Main
# ====================================================================================================================


class _Parser(argparse.ArgumentParser):
    """Reads a per-boundary codec list that starts with an uncompressed boundary (``-,q4,-/-,q8,-``) as a value:
    argparse would take any word that starts with ``-`` for an unknown option."""

    def _parse_optional(self, arg_string):
        if arg_string.startswith(("-,", "-/")):
            return None
        return super()._parse_optional(arg_string)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="60 steps, validation every 20 (about a minute or two per run; 36 minutes for all the runs "
                           "over three delayed links)")
    size.add_argument("--tiny", action="store_true", help="smoke test: 2 stages, tiny model, 3 steps, one link")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the JSON, CSV and PNG (default benchmarks/results; --tiny: a temp folder)")
    ap.add_argument("--stem", default=None,
                    help="file name of the results without extension (default slow_network, with _delay when a link "
                         "has a delay and _quick in quick mode: a quick or delayed run keeps the full run's files)")
    ap.add_argument("--links", type=parse_link, nargs="+", default=None, metavar="RATE[@DELAY]",
                    help="links in Mbit/s, each optionally with a one-way delay in ms: 100 (kernel veth + tbf), "
                         "100@25 (user-space relay, 25 ms each way), 100@0 (relay, no delay) (default: 100 25)")
    ap.add_argument("--delay-ms", type=float, default=None,
                    help="one-way delay for every link given without @DELAY (then all go through the relay)")
    ap.add_argument("--sites", type=parse_sites, default=None, metavar="S0,S1,...",
                    help="a mixed cluster: the site of each stage, e.g. 0,0,1,1; the links' rate and delay then apply "
                         "between sites only, within a site packets pass at once (needs delayed links)")
    ap.add_argument("--validate-only", action="store_true",
                    help="set up each link, print its measured RTT and throughput against its configuration, exit")
    ap.add_argument("--burst", default="8kb", help="tbf burst (keep it small, or small messages escape the shaping)")
    ap.add_argument("--latency", default="100ms",
                    help="tbf latency (queue limit); on delayed links the relay's queue bound (tail drop)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--val-every", type=int, default=None)
    ap.add_argument("--val-batches", type=int, default=None)
    ap.add_argument("--skip", type=int, default=None, help="first steps left out of the median step time")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--budget", type=float, default=1.0,
                    help="compressed variants may train up to this many times the steps of uncompressed (default 1: "
                         "the same steps for all; > 1 gives a variant that is slower per step a chance to reach the "
                         "target, at its own cost in time)")
    ap.add_argument("--p", type=float, default=0.5, help="lazy-sampling p of clapping-fc")
    ap.add_argument("--fu-p", type=float, nargs="*", default=[0.5, 0.2],
                    help="lazy-sampling p values of clapping-fu (none with an empty list)")
    ap.add_argument("--fc-extra", nargs="*", default=["q4/q4"], metavar="FWD/BWD",
                    help="further clapping-fc variants with these codec pairs on the shaped links (default q4/q4: "
                         "4-bit gradients too; none with an empty list); a codec may be one per boundary, - for "
                         "uncompressed: -,q4,-/-,q8,- compresses boundary 1 only")
    ap.add_argument("--no-direct", action="store_true",
                    help="leave out the direct-compression baseline (the codecs below, no error feedback, p = 1)")
    ap.add_argument("--no-aqsgd", action="store_true",
                    help="leave out the AQ-SGD baseline (forward: per-sample buffers, first visits in full; backward: "
                         "direct; the codecs below, p = 1)")
    ap.add_argument("--frontier", action="store_true",
                    help="also run the best frontier configuration of the quality benchmark (clapping-fu p=0.5, "
                         "randk:0.1+q4 both ways, fresh steps q4:fp16)")
    ap.add_argument("--auto-schedule", action="store_true",
                    help="also run auto with schedule='auto' (it starts with 1F1B and may switch to GPipe)")
    ap.add_argument("--no-auto", action="store_true",
                    help="leave out the autotune row (clapping-fc at --p with autotune=True; only added when the "
                         "strategy has that parameter)")
    ap.add_argument("--forward-codec", default="q4")
    ap.add_argument("--backward-codec", default="q8")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                    help="pipeline schedule of every run (default 1f1b; gpipe runs all forwards, then all backwards)")
    ap.add_argument("--no-loopback-fc", action="store_true",
                    help="skip clapping-fc on loopback (it shows the codecs' compute cost without a network)")
    ap.add_argument("--loopback-only", action="store_true",
                    help="run every variant on loopback and no shaped link (the loss trajectories, which do not "
                         "depend on the link; benchmarks/time_to_target.py uses them)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the per-rank logs (their folder is printed)")
    ap.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0

    mode = make_mode(args)
    if args.loopback_only:
        mode.links = []
    delayed = any(x.delay_ms is not None for x in mode.links)
    reason = delay_unavailable_reason() if delayed else unavailable_reason()
    if reason:
        print(f"slow_network: cannot run: {reason}", file=sys.stderr)
        return 2
    if args.validate_only:
        return validate_only(mode, args)
    variants = make_variants(args)
    check_variant_codecs(variants, mode.stages - 1)
    loop_variants = loopback_variants(variants, args)
    out = args.out or (Path(tempfile.gettempdir()) / "slow_network_tiny" if args.tiny else ROOT / "benchmarks/results")
    stem = output_stem(mode, args)
    layers_per_stage = mode.layers // mode.stages or 1
    cuts = [k * layers_per_stage for k in range(1, mode.stages)]
    base_cfg = {k: getattr(mode, k) for k in ("stages", "d", "heads", "layers", "block", "batch", "microbatches",
                                              "steps", "val_every", "val_batches", "data_limit", "seed")}
    base_cfg.update(cuts=cuts, threads=args.threads, strategy_timeout=300, schedule=args.schedule)
    info = machine()
    settings = dict(asdict(mode), budget=args.budget, burst=args.burst, latency=args.latency,
                    sites=None if args.sites is None else list(args.sites),
                    shaping={x.label: shaping_text(x, args) for x in mode.links},
                    threads_per_rank=args.threads,
                    split_points=[f"blocks.{c}" for c in cuts], schedule=args.schedule,
                    optimizer="AdamW lr 1e-3 wd 0.01, linear warm-up 20 steps (examples/char_lm.py)",
                    prepost_receives="strategy default (on for gloo)",
                    fp32_message_bytes=fp32_message_bytes(mode), variants=[asdict(v) for v in variants],
                    loopback_variants=[v.label for v in loop_variants],
                    strategy_has_autotune=strategy_accepts("autotune"), metrics_lag_note="clapping/... values are "
                    "logged a step late by the strategy; per-step rows are re-aligned to their own step",
                    delay_floor_bound=DELAY_FLOOR_BOUND, command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]))
    print(f"machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, torch {info['torch']}, lightning "
          f"{info['lightning']}, Python {info['python']}, kernel {info['kernel']}, load average "
          f"{', '.join(f'{x:.2f}' for x in info['load_average_at_start'])}")
    print(f"mode {mode.name}: {mode.stages} stages (split at {settings['split_points']}), CharTransformer d={mode.d} "
          f"heads={mode.heads} layers={mode.layers} block={mode.block}, batch {mode.batch}, {mode.microbatches} "
          f"micro-batches, {args.schedule.upper()}, {mode.steps} steps, validation every {mode.val_every} steps on "
          f"{mode.val_batches} fixed batches, median over steps > {mode.skip}, seed {mode.seed}, {args.threads} "
          "thread(s) per rank"
          + (f", compressed variants up to {args.budget:g}x the steps" if args.budget != 1.0 else ""))
    print(f"links: {'; '.join(f'{x.label} ({shaping_text(x, args)})' for x in mode.links)}; and loopback; fp32 "
          f"message per boundary and direction per step: "
          f"{fp32_message_bytes(mode) / MiB:.3f} MiB")
    print(f"variants: {', '.join(v.label for v in variants)} (codecs {args.forward_codec} forward / "
          f"{args.backward_codec} backward); on loopback: {', '.join(v.label for v in loop_variants)}"
          + ("" if settings["strategy_has_autotune"] else "; no auto row: this ClappingStrategy has no autotune "
             "parameter"))
    print(f"results: {out / stem}.{{json,csv,png}}\n")

    workdir = Path(tempfile.mkdtemp(prefix="slow_network_"))
    lab = Lab()
    runner = Runner(lab, workdir)
    atexit.register(runner.close)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    rows: list[dict] = []
    checks: list[dict] = []
    t_all = time.monotonic()
    try:
        stage_eps, delay_eps = build_links(lab, mode)
        loop_ep = lab.build_loopback()
        plan: list[tuple[LinkSpec | None, Variant]] = [(None, v) for v in loop_variants]
        plan += [(link, v) for link in mode.links for v in variants]
        checked = None
        for i, (link, variant) in enumerate(plan):
            if link is not None and link != checked:  # a new link: measure what it really does, before its runs
                checked = link
                checks.append(check_link(lab, link, configure_link(lab, link, args, stage_eps, delay_eps), args))
                c = checks[-1]
                print(f"link {link.label}: RTT {_fmt(c['rtt_ms_median'], '.2f')} ms (expect {c['expected_rtt_ms']:g}),"
                      f" TCP {_fmt(c['steady_mbit_s'], '.1f')} Mbit/s bulk, {_fmt(c['mbit_s'], '.1f')} whole: "
                      f"{c['verdict']}" + (f" ({'; '.join(c['problems'])})" if c["problems"] else ""))
            fp32 = fp32_message_bytes(mode)
            wire = 0.0 if link is None else 2 * fp32 * 8 / (link.rate_mbit * 1e6)  # busiest link, fp32, per step
            # a delayed link: at most one wait per micro-batch, boundary and direction (a generous bound)
            lag = 0.0 if link is None else 2 * (mode.stages - 1) * (mode.microbatches + 2) * (link.delay_ms or 0) / 1e3
            n_steps = max(mode.steps, round(mode.steps * args.budget))
            n_vals = n_steps // mode.val_every
            timeout = 180 + 4 * (n_steps * (wire + lag + 0.6) + n_vals * mode.val_batches * (wire / 2 + lag + 0.3))
            cfg = dict(base_cfg, variant=asdict(variant))
            if variant.variant != "uncompressed" and args.budget != 1.0:
                cfg["steps"] = max(mode.val_every, round(mode.steps * args.budget / mode.val_every) * mode.val_every)
            name = "loopback" if link is None else link.key
            key = f"{i:02d}_{name}_{variant.label.replace(' ', '_').replace('=', '')}"
            if link is None:
                endpoints, before = [loop_ep] * mode.stages, None
            else:  # each run on a fresh link: tbf reshaped, or a new relay (its counters then cover this run only)
                endpoints = configure_link(lab, link, args, stage_eps, delay_eps)
                before = lab.counters(endpoints)
            load_before = os.getloadavg()[0]
            relayed = link is not None and link.delay_ms is not None
            relay_cpu0 = (lab.relay_stats() or {}).get("cpu_s") if relayed else None
            print(f"[{i + 1}/{len(plan)}] {name:<14} {variant.label:<24} ...", end=" ", flush=True)
            raw = runner.run(key, cfg, endpoints, timeout)
            counters = Lab.delta(before, lab.counters(endpoints)) if before is not None else None
            row = summarize(raw, mode, link, variant, counters)
            row["relay"] = relay_summary(lab.relay_stats()) if relayed else None
            if row["relay"] and relay_cpu0 is not None and raw["wall_seconds"] > 0:
                # the relay is this benchmark's own process (it carries the links), not a disturbance: its CPU time
                # during the run is taken out of "other" and reported on its own
                row["relay_cores"] = max(0.0, row["relay"]["cpu_s"] - relay_cpu0) / raw["wall_seconds"]
                row["other_cores_with_relay"] = row["other_cores"]
                row["other_cores"] = max(0.0, row["other_cores"] - row["relay_cores"])
            row["load_before"], row["load_after"] = load_before, os.getloadavg()[0]
            rows.append(row)
            if row["error"]:
                print(f"FAILED ({row['error']})\n{raw.get('log_tail', '')}")
            else:
                print(f"{row['median_step_s']:.3f} s/step, {row['bytes_per_step'] / MiB:.3f} MiB/step, final val "
                      f"{row['final_val_loss']:.4f}, {raw['wall_seconds']:.0f} s wall, other jobs used "
                      f"{row['other_cores']:.2f} of {os.cpu_count()} cores meanwhile"
                      + (f"; WARNING: {row['warning']}" if row["warning"] else ""))
    finally:
        runner.close()
        if args.keep_logs:
            print(f"per-rank logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    add_comparisons(rows)
    targets = evaluate_targets(rows)
    ranking = first_to_target(rows)
    print("\nlinks as measured before their runs (configured rate and delay against what a ping and a TCP transfer "
          "saw):")
    print_link_checks(checks)
    print()
    print_table(rows)
    print(f"\nshaping check (tbf burst {args.burst}; overlimits/drops: whole run, all stage veths; relay: queue drops, "
          "and how late it delivered, p99 of the worst link / max, ms; veth/strategy: bytes out of each rank's "
          "interface during its training steps / bytes the strategy counted for that rank):")
    for r in (r for r in rows if r["rate_mbit"] is not None and not r["error"]):
        ratios = ", ".join(_fmt(e.get("veth_over_strategy"), ".3f") for e in r["per_rank"])
        relay = r.get("relay")
        if relay:
            shaped = (f"relay {relay['queue_drops']:>5} drops, late {_fmt(relay['late_ms_p99_worst_link'], '.2f')}/"
                      f"{_fmt(relay['late_ms_max'], '.1f')} ms, {relay['cpu_s']:.1f} s CPU")
        else:
            shaped = f"{r.get('tbf_overlimits', 0):>8} overlimits {r.get('tbf_drops', 0):>4} drops"
        floor = (f"; step {r['x_delay_floor']:.2f}x the delay floor {r['delay_floor_step_s']:.3f} s"
                 if r.get("x_delay_floor") else "")
        print(f"  {r['link']:<16} {r['variant']:<24} {shaped}; smallest message "
              f"{r['min_message_bytes'] / 1024:6.1f} KiB; veth/strategy per rank {ratios}{floor}")
    print("\nbytes per step and boundary from the strategy's logged clapping/b{m}_fwd_bytes / _bwd_bytes (mean over "
          "the steps they describe: all but the last, as they are logged a step late; MiB; fp32 payload "
          f"{fp32_message_bytes(mode) / MiB:.3f} MiB):")
    for r in (r for r in rows if not r["error"] and r["link"] == (mode.links[0].label if mode.links else None)):
        pairs = "  ".join(f"b{m} {f / MiB:.3f}/{b / MiB:.3f}" for m, (f, b) in
                          enumerate(zip(r["fwd_bytes_per_boundary"], r["bwd_bytes_per_boundary"])) if f and b)
        print(f"  {r['variant']:<24} fwd/bwd: {pairs}")
    print("\ntargets (char-LM):" if mode.name != "tiny" else "\ntargets (tiny model: not meaningful, printed to test "
                                                             "the code path):")
    for t in targets:
        print(f"  {t['verdict']:<8} {t['target']} (measured {_fmt(t['value'], '.2f')})")
    print("\nfirst to the target (uncompressed's final val loss on the link), per link:")
    for link, order in ranking.items():
        reached = [f"{e['variant']} {e['time_to_target_s']:.1f} s" for e in order if e["time_to_target_s"] is not None]
        missed = [e["variant"] for e in order if e["time_to_target_s"] is None]
        print(f"  {link}: {', then '.join(reached) or 'nobody'}" + (f"; not reached: {', '.join(missed)}"
                                                                      if missed else ""))
    for r in rows:
        if r["kind"] == "clapping-fu" and not r["error"]:
            ttt = (f"time-to-target {r['ttt_speedup']:.2f}x shorter" if r.get("ttt_speedup")
                   else "target loss not reached")
            print(f"  clapping-fu p={r['p']:g} on {r['link']}: median step {_fmt(r.get('step_speedup'), '.2f')}x and "
                  f"mean step {_fmt(r.get('mean_step_speedup'), '.2f')}x faster "
                  f"than uncompressed, {ttt}")

    busy = [r for r in rows if (r.get("other_cores") or 0) > 0.2]
    if busy:
        print(f"\nWARNING: other processes used more than 0.2 CPU cores during {len(busy)} run(s) "
              f"({', '.join(r['link'] + ' ' + r['variant'] for r in busy)}): their timings are slowed down; "
              "re-run on a quiet machine before quoting them.")
    info["load_average_at_end"] = list(os.getloadavg())
    info["total_wall_seconds"] = time.monotonic() - t_all
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(
        {"machine": info, "settings": settings, "links": checks, "runs": rows, "targets": targets,
         "first_to_target": ranking}, indent=1, default=str))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    try:
        plot(rows, mode.links, settings["shaping"], out / f"{stem}.png")
        plotted = f" and {out / f'{stem}.png'}"
    except ImportError:
        plotted = " (no plot: matplotlib is not installed)"
    print(f"\nwrote {out / f'{stem}.json'}, {out / f'{stem}.csv'}{plotted} "
          f"({info['total_wall_seconds']:.0f} s in all)")
    return 1 if any(r["error"] for r in rows) else 0


def build_links(lab: Lab, mode: Mode) -> tuple[list[Endpoint], list[Endpoint]]:
    """The veth star if a link needs it, the delay star (TUN devices) if a link has a delay."""
    stage_eps = lab.build_star(mode.stages) if any(x.delay_ms is None for x in mode.links) else []
    delay_eps = (lab.build_delay_star(max(2, mode.stages)) if any(x.delay_ms is not None for x in mode.links)
                 else [])
    return stage_eps, delay_eps


def validate_only(mode: Mode, args: argparse.Namespace) -> int:
    """Build the links, measure each against its configuration, print the table, save it, tear down. Exit 1 if a
    link is off its configuration."""
    out = args.out or Path(tempfile.gettempdir()) / "slow_network_links"
    print(f"links: {'; '.join(f'{x.label} ({shaping_text(x, args)})' for x in mode.links)}; "
          f"{mode.stages} stage namespaces")
    t0 = time.monotonic()
    lab = Lab()
    atexit.register(lab.teardown)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    checks = []
    try:
        stage_eps, delay_eps = build_links(lab, mode)
        for link in mode.links:
            endpoints = configure_link(lab, link, args, stage_eps, delay_eps)
            checks.append(check_link(lab, link, endpoints, args))
    except NetnsError as err:
        print(f"slow_network: link set-up or measurement failed: {err}", file=sys.stderr)
        return 2
    finally:
        lab.teardown()
    print()
    print_link_checks(checks)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    (out / "slow_network_links.json").write_text(json.dumps(
        {"machine": {"kernel": platform.release(), "logical_cpus": os.cpu_count(), "load_average_at_end": list(load)},
         "settings": {"burst": args.burst, "latency": args.latency, "stages": mode.stages,
                      "sites": None if args.sites is None else list(args.sites),
                      "links": [asdict(x) for x in mode.links]}, "links": checks}, indent=1))
    print(f"\nwrote {out / 'slow_network_links.json'} ({time.monotonic() - t0:.0f} s; load average "
          f"{', '.join(f'{x:.2f}' for x in load)})")
    return 0 if all(c["verdict"] == "ok" for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
