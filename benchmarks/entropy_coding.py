"""Entropy coding on top of the quantizers: what lossless rANS coding of the codes would save on real messages.

    pip install constriction==0.5.0
    python benchmarks/entropy_coding.py [--tiny] [--steps N] [--tasks fashion_mnist shakespeare]
                                        [--codecs q2 q3 q4 q8 ...] [--out benchmarks/results]

The quantizer ``q<b>`` packs every code in exactly ``b`` bits. Codes of real messages are far from uniform (most
values sit near zero, and an error-feedback difference on a reused batch is small next to the channel's max-abs),
so a lossless entropy coder could send them in fewer bits. This script measures how many, on messages taken from
real training, and what the coder costs in time.

Messages. One process trains a task of ``benchmarks/_quality_tasks.py`` without any pipeline or compression: the
Fashion-MNIST MLP (Adam, batch 128, 4 micro-batches) and the Shakespeare character transformer (AdamW with its
warm-up, batch 32, 8 micro-batches, gradient clipping at 1.0), for ``--steps`` steps (default 60) with lazy
sampling: step 0 draws a fresh batch, every later step draws a fresh one with probability ``--p`` (default 0.5,
from a seeded generator) and otherwise trains on the same batch again. At each cut (a split point of the task: the
input of ``net.2`` and ``net.4`` of the MLP, of ``blocks.2`` of the transformer) a forward pre-hook records the
activation ``a`` and a tensor hook the gradient ``g`` of the batch loss with respect to it. Each is split into the
task's micro-batches, one message per micro-batch as the pipeline sends them (``[32, 512]``, ``[32, 256]`` and
``[4, 128, 128]``).

Each message goes through the package's own rule, ``lightning_clapping.codecs.feedback.MessageRule``, once per
codec and direction: variant ``clapping-fc`` (one buffer per micro-batch slot; warm start: step 0 is sent in full
and not counted; then the codec compresses ``a - A`` and both ends add the decoded difference to ``A``) and variant
``direct`` (the codec compresses ``a`` itself); the same for ``g``. These are open-loop messages: training uses the
exact ``a`` and ``g``, so the buffers follow the uncompressed run, not a run whose stages see the decoded values.
Codecs: the project's quantizers (``q2``, ``q3``, ``q4``, ``q8``: per-channel float32 scales, round to nearest;
``q4:fp16``, ``q8:fp16``: fp16 scales).

Sizes, per message of ``n`` values with ``2L + 1`` code symbols (``L = 2**(b-1) - 1``):

* packed: the codec's payload bytes (scales + ``ceil(n*b/8)`` bytes of bit-packed codes).
* codes: read back from the payload with ``unpack_bits``; before the first use of each codec the script checks
  that ``(c * 2/(2L) - 1) * s`` rebuilt from them equals the codec's ``decode`` of the same payload.
* entropy: the empirical entropy ``H`` of the message's code histogram, in bits per value.
* rANS: the codes coded with ``constriction.stream.stack.AnsCoder`` under a ``constriction.stream.model.Categorical``
  built from the message's own histogram (``perfect=False``); its size is the compressed ``uint32`` words, plus the
  model (the histogram sent as ``2L + 1`` uint32 counts), plus the codec's scales unchanged. Every message is decoded
  again and compared with the codes. ``ideal`` is the scales plus ``n*H/8`` bytes (no model, no coder overhead).
* ratio: packed bytes / rANS bytes of one step (all micro-batches of the step summed), averaged over the steps
  with a compressed message; also over fresh steps and reuse steps separately, and as total / total. ``best``
  sends each message the smaller way (packed or rANS; the choice would cost one flag bit, not counted).

Cost. On one tensor of 2**20 fp32 values (real activations of the last task's first cut, stacked over the last
steps, reshaped to ``[rows, channels]``), the script times, median of ``--repeats`` after warm-up and with the CPU
caches flushed before each operation as ``codec_speed.py`` does: ``y.copy_(x)``; ``q4`` encode and decode; and rANS
encode (histogram, model, coding, from the uint8 codes) and decode (model, decoding, back to uint8 codes). rANS
would run in addition to the quantizer (the codes have to be computed and turned back into values either way), so
the table gives its time against the memory copy and against ``q4``'s encode + decode.

``--tiny`` (a few seconds, for the smoke test) trains a small MLP on scikit-learn's digits (64-128-64-10, cut at
``net.2``, batch 64, 2 micro-batches, 6 steps) with ``q4`` and ``q8`` and times 2**16 values. One torch thread by
default (``--threads``). Results go to ``entropy_coding.json`` and ``entropy_coding.csv`` under ``--out``, with
a description of the machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from _machine import describe  # noqa: E402
from _table import table  # noqa: E402
from codec_speed import CacheFlush  # noqa: E402  (the same flush before every timed operation)

from lightning_clapping.codecs import QuantCodec, get_codec, unpack_bits  # noqa: E402
from lightning_clapping.codecs.feedback import MessageRule, StepContext  # noqa: E402
from lightning_clapping.comm.wire import CODEC, FULL  # noqa: E402

CODECS = ["q2", "q3", "q4", "q8", "q4:fp16", "q8:fp16"]
TINY_CODECS = ["q4", "q8"]
TASKS = ["fashion_mnist", "shakespeare"]
CUTS = {"fashion_mnist": ["net.2", "net.4"], "shakespeare": ["blocks.2"], "digits": ["net.2"]}
KINDS = ["fc-forward", "fc-backward", "direct-forward", "direct-backward"]
TIMED_VALUES = 1 << 20


# ---------------------------------------------------------------------------------------------------- codes and rANS


def codes_of(codec: QuantCodec, payload: torch.Tensor, n_scales: int, n: int) -> torch.Tensor:
    """The ``n`` unsigned codes (uint8) of a ``q<b>`` payload: the bytes after its scales, unpacked."""
    return unpack_bits(payload[codec._scale_nbytes(n_scales):], n, codec.bits)


def check_codes(codec: QuantCodec, payload: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise unless the codes read from ``payload`` and its scales rebuild what ``codec.decode`` returns."""
    n_scales, _ = codec._layout(shape)
    n = math.prod(shape)
    codes = codes_of(codec, payload, n_scales, n).float()
    scales = codec._read_scales(payload, n_scales)
    per_value = scales.repeat(n // n_scales) if n_scales > 1 else scales.expand(n)
    rebuilt = (codes * (2.0 / codec.top_code) - 1.0) * per_value
    decoded = codec.decode(payload, torch.Size(shape), torch.float32).reshape(-1)
    if not torch.allclose(rebuilt, decoded, rtol=1e-6, atol=1e-6 * float(scales.abs().max())):
        raise AssertionError(f"{codec.name}: codes read from the payload do not rebuild the codec's decode")


def entropy_bits(hist: np.ndarray) -> float:
    """Empirical entropy of a histogram, bits per value."""
    p = hist[hist > 0] / hist.sum()
    return float(-(p * np.log2(p)).sum())


def rans_encode(codes: torch.Tensor, alphabet: int):
    """(compressed uint32 words, histogram) of ``codes`` coded with rANS under their own histogram."""
    import constriction

    hist = torch.bincount(codes, minlength=alphabet).numpy()
    model = constriction.stream.model.Categorical(hist.astype(np.float64), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(codes.numpy().astype(np.int32), model)
    return coder.get_compressed(), hist


def rans_decode(words: np.ndarray, hist: np.ndarray, n: int) -> torch.Tensor:
    import constriction

    model = constriction.stream.model.Categorical(hist.astype(np.float64), perfect=False)
    return torch.from_numpy(constriction.stream.stack.AnsCoder(words).decode(model, n).astype(np.uint8))


# ---------------------------------------------------------------------------------------------------- tasks


@dataclass
class Setup:
    name: str
    model: torch.nn.Module
    loader: object
    cuts: list[str]
    microbatches: int
    optimizer: torch.optim.Optimizer
    scheduler: object = None
    clip: float | None = None


def build(name: str, seed: int) -> Setup:
    import lightning as L

    L.seed_everything(seed, verbose=False)
    if name == "digits":
        from datasets import DigitsDataModule

        from _quality_tasks import MLP

        dm = DigitsDataModule(batch_size=64, seed=seed)
        model, microbatches, clip = MLP(widths=(64, 128, 64, 10)), 2, None
    else:
        from _quality_tasks import TASKS as QUALITY_TASKS

        task = QUALITY_TASKS[name]
        dm = task.make_data(seed, None, None, task.batch_size)
        dm.setup("fit")
        model, microbatches, clip = task.make_model(dm), task.microbatches, task.gradient_clip_val
    conf = model.configure_optimizers()
    if isinstance(conf, dict):
        optimizer, scheduler = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    else:
        optimizer, scheduler = conf, None
    return Setup(name, model, dm.train_dataloader(), CUTS[name], microbatches, optimizer, scheduler, clip)


def missing(name: str) -> str | None:
    from datasets import missing_reason

    return missing_reason(name)


# ---------------------------------------------------------------------------------------------------- accounting


@dataclass
class Series:
    """One (task, cut, kind, codec): per step, summed over the step's micro-batch messages."""

    task: str
    cut: str
    kind: str
    codec: str
    values_per_message: int = 0
    scale_bytes: int = 0
    model_bytes: int = 0
    steps: list[int] = field(default_factory=list)
    fresh: list[bool] = field(default_factory=list)
    packed: list[int] = field(default_factory=list)
    rans: list[int] = field(default_factory=list)
    rans_codes: list[int] = field(default_factory=list)  # the uint32 words alone
    best: list[int] = field(default_factory=list)  # per message the smaller of packed and rANS
    ideal: list[float] = field(default_factory=list)
    entropy_x_values: list[float] = field(default_factory=list)  # sum over messages of H * n
    values: list[int] = field(default_factory=list)

    def add(self, step: int, fresh: bool, n: int, packed: int, scale_bytes: int, model_bytes: int, words: int,
            h: float) -> None:
        if not self.steps or self.steps[-1] != step:
            self.steps.append(step)
            self.fresh.append(fresh)
            for lst in (self.packed, self.rans, self.rans_codes, self.best, self.ideal, self.entropy_x_values,
                        self.values):
                lst.append(0)
        self.values_per_message, self.scale_bytes, self.model_bytes = n, scale_bytes, model_bytes
        self.packed[-1] += packed
        coded = scale_bytes + model_bytes + 4 * words
        self.rans[-1] += coded
        self.best[-1] += min(packed, coded)
        self.rans_codes[-1] += 4 * words
        self.ideal[-1] += scale_bytes + n * h / 8
        self.entropy_x_values[-1] += n * h
        self.values[-1] += n

    def row(self) -> dict:
        ratios = [p / r for p, r in zip(self.packed, self.rans)]

        def mean_where(xs, want):
            picked = [x for x, f in zip(xs, self.fresh) if want is None or f == want]
            return statistics.fmean(picked) if picked else None

        def per_value(xs, want):
            picked = [(x, v) for x, v, f in zip(xs, self.values, self.fresh) if want is None or f == want]
            return sum(x for x, _ in picked) / sum(v for _, v in picked) if picked else None

        bits = int(self.codec[1:].split(":")[0])
        return {
            "task": self.task, "cut": self.cut, "kind": self.kind, "codec": self.codec, "bits": bits,
            "steps": len(self.steps), "fresh_steps": sum(self.fresh), "reuse_steps": len(self.fresh) - sum(self.fresh),
            "values_per_message": self.values_per_message,
            "messages_per_step": self.values[0] // self.values_per_message if self.values else 0,
            "scale_bytes_per_message": self.scale_bytes, "model_bytes_per_message": self.model_bytes,
            "packed_bytes_per_step": statistics.fmean(self.packed),
            "rans_bytes_per_step": statistics.fmean(self.rans),
            "entropy_bits_per_value": per_value(self.entropy_x_values, None),
            "entropy_bits_fresh": per_value(self.entropy_x_values, True),
            "entropy_bits_reuse": per_value(self.entropy_x_values, False),
            "rans_code_bits_per_value": 8 * per_value(self.rans_codes, None),
            "ratio_mean": mean_where(ratios, None),
            "ratio_fresh": mean_where(ratios, True),
            "ratio_reuse": mean_where(ratios, False),
            "ratio_total": sum(self.packed) / sum(self.rans),
            "ratio_best_mean": mean_where([p / b for p, b in zip(self.packed, self.best)], None),
            "ratio_ideal_mean": mean_where([p / i for p, i in zip(self.packed, self.ideal)], None),
            "ratio_per_step": [round(r, 4) for r in ratios],
            "fresh_per_step": self.fresh,
        }


# ---------------------------------------------------------------------------------------------------- the run


def run_task(name: str, steps: int, p: float, codecs: list[str], seed: int,
             stash_rows: int) -> tuple[list[dict], dict, torch.Tensor]:
    setup = build(name, seed)
    model = setup.model.train()
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def hook_for(cut):
        def pre(module, args):
            x = args[0]
            acts[cut] = x.detach().clone()
            x.register_hook(lambda g: grads.__setitem__(cut, g.detach().clone()))

        return pre

    for cut in setup.cuts:
        model.get_submodule(cut).register_forward_pre_hook(hook_for(cut))

    rules = {(cut, variant, direction, spec): MessageRule(variant, spec, boundary=i, direction=direction)
             for i, cut in enumerate(setup.cuts) for variant in ("clapping-fc", "direct")
             for direction in ("fwd", "bwd") for spec in codecs}
    series: dict[tuple, Series] = {}
    checked: set[str] = set()
    stash: list[torch.Tensor] = []  # the first cut's activations of the last steps, for the timing
    gen = torch.Generator().manual_seed(seed + 1)
    batches, batch = iter(setup.loader), None
    fresh_log, losses = [], []
    t_train = t_codec = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        fresh = step == 0 or float(torch.rand((), generator=gen)) < p
        if fresh:
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(setup.loader)
                batch = next(batches)
        x, y = batch[0], batch[1]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        setup.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if setup.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip)
        setup.optimizer.step()
        if setup.scheduler is not None:
            setup.scheduler.step()
        fresh_log.append(fresh)
        losses.append(float(loss.detach()))
        t1 = time.perf_counter()
        t_train += t1 - t0

        first = acts[setup.cuts[0]]
        stash = (stash + [first.reshape(-1, first.shape[-1])])[-stash_rows:]
        for cut in setup.cuts:
            for direction, full in (("fwd", acts[cut]), ("bwd", grads[cut])):
                slots = list(torch.chunk(full, setup.microbatches, dim=0))
                ctx = StepContext(step=step, fresh=fresh, sizes=[s.shape[0] for s in slots])
                for spec in codecs:
                    codec = get_codec(spec)
                    for variant in ("clapping-fc", "direct"):
                        rule = rules[(cut, variant, direction, spec)]
                        kind = f"{'fc' if variant == 'clapping-fc' else 'direct'}-{'forward' if direction == 'fwd' else 'backward'}"
                        key = (cut, kind, spec)
                        s = series.setdefault(key, Series(name, cut, kind, spec))
                        for slot, t in enumerate(slots):
                            t = t.contiguous()
                            if direction == "fwd":
                                t = t.requires_grad_()  # a forward tensor is compressed only when it carries a gradient
                            part = rule.encode(slot, [t], ctx)[0]
                            if part.codec == FULL:  # clapping-fc's warm start: sent in full, not counted
                                continue
                            assert part.codec == CODEC, part.codec
                            shape = tuple(t.shape)
                            if spec not in checked:
                                check_codes(codec, part.payload, shape)
                                checked.add(spec)
                            n_scales, _ = codec._layout(shape)
                            n = t.numel()
                            codes = codes_of(codec, part.payload, n_scales, n)
                            alphabet = codec.top_code + 1
                            words, hist = rans_encode(codes, alphabet)
                            if not torch.equal(rans_decode(words, hist, n), codes):
                                raise AssertionError(f"rANS round trip failed: {name} {cut} {kind} {spec} step {step}")
                            s.add(step, fresh, n, part.payload.numel(), codec._scale_nbytes(n_scales), 4 * alphabet,
                                  words.size, entropy_bits(hist))
        t_codec += time.perf_counter() - t1
    info = {"task": name, "cuts": setup.cuts, "microbatches": setup.microbatches, "steps": steps,
            "fresh_steps": sum(fresh_log), "fresh_per_step": fresh_log, "loss_first": losses[0],
            "loss_last": losses[-1], "train_s": t_train, "codec_s": t_codec,
            "message_shapes": {cut: list(torch.chunk(acts[cut], setup.microbatches)[0].shape) for cut in setup.cuts}}
    return [s.row() for s in series.values()], info, torch.cat(stash)


# ---------------------------------------------------------------------------------------------------- timing


def time_codecs(source: torch.Tensor, values: int, warmup: int, repeats: int) -> dict:
    """Medians (ms) of copy, q4 encode/decode and rANS encode/decode on ``values`` fp32 values from ``source``."""
    cols = source.shape[-1]
    rows = values // cols
    flat = source.reshape(-1)
    reps = -(-rows * cols // flat.numel())
    x = flat.repeat(reps)[: rows * cols].reshape(rows, cols).contiguous()
    y = torch.empty_like(x)
    codec = get_codec("q4")
    n_scales, _ = codec._layout(tuple(x.shape))
    flush = CacheFlush(enabled=True)
    times = {"copy": [], "q4_encode": [], "q4_decode": [], "rans_encode": [], "rans_decode": []}
    words = hist = None
    for i in range(warmup + repeats):
        flush()
        t0 = time.perf_counter()
        y.copy_(x)
        t1 = time.perf_counter()
        flush()
        t2 = time.perf_counter()
        payload = codec.encode(x)
        t3 = time.perf_counter()
        flush()
        t4 = time.perf_counter()
        codec.decode(payload, x.shape, x.dtype)
        t5 = time.perf_counter()
        codes = codes_of(codec, payload, n_scales, x.numel())
        flush()
        t6 = time.perf_counter()
        words, hist = rans_encode(codes, codec.top_code + 1)
        t7 = time.perf_counter()
        flush()
        t8 = time.perf_counter()
        back = rans_decode(words, hist, x.numel())
        t9 = time.perf_counter()
        if not torch.equal(back, codes):
            raise AssertionError("rANS round trip failed on the timed tensor")
        if i >= warmup:
            for k, dt in zip(times, (t1 - t0, t3 - t2, t5 - t4, t7 - t6, t9 - t8)):
                times[k].append(dt)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    packed = codec.payload_nbytes(x.shape, x.dtype)
    coded = codec._scale_nbytes(n_scales) + 4 * (codec.top_code + 1) + 4 * words.size
    q4 = med["q4_encode"] + med["q4_decode"]
    rans = med["rans_encode"] + med["rans_decode"]
    return {
        "shape": list(x.shape), "values": x.numel(), "codec": "q4", "warmup": warmup, "repeats": repeats,
        **{f"{k}_ms": v for k, v in med.items()},
        "q4_encode_decode_ms": q4, "rans_encode_decode_ms": rans,
        "rans_over_copy": rans / med["copy"], "rans_over_q4": rans / q4,
        "q4_over_copy": q4 / med["copy"], "q4_plus_rans_over_copy": (q4 + rans) / med["copy"],
        "rans_mvalues_per_s": x.numel() / rans / 1e3,
        "entropy_bits_per_value": entropy_bits(hist), "packed_bytes": packed, "rans_bytes": coded,
        "ratio": packed / coded,
    }


# ---------------------------------------------------------------------------------------------------- report


def print_table(rows: list[dict]) -> None:
    print(table([(r["task"], r["cut"], r["kind"], r["codec"], r["values_per_message"], r["packed_bytes_per_step"],
                  r["entropy_bits_per_value"], r["rans_code_bits_per_value"], r["ratio_mean"], r["ratio_fresh"],
                  r["ratio_reuse"], r["ratio_best_mean"], r["ratio_ideal_mean"]) for r in rows],
                ["task", "cut", "kind", "codec", "values", "packed B", "H b/v", "rANS b/v", "ratio", "fresh", "reuse",
                 "best", "ideal"],
                floatfmt=(None,) * 5 + (".0f", ".2f", ".2f") + (".2f",) * 5, colalign=("left",) * 4 + ("right",) * 9))


def print_timing(t: dict) -> None:
    print(f"\nCost on {t['values']} values ({t['shape'][0]}x{t['shape'][1]} fp32, {t['source']}), medians of "
          f"{t['repeats']} repeats, caches flushed:")
    print(f"  memory copy          {t['copy_ms']:8.3f} ms")
    print(f"  q4 encode + decode   {t['q4_encode_decode_ms']:8.3f} ms  ({t['q4_encode_ms']:.3f} + "
          f"{t['q4_decode_ms']:.3f}; {t['q4_over_copy']:.1f}x the copy)")
    print(f"  rANS encode + decode {t['rans_encode_decode_ms']:8.3f} ms  ({t['rans_encode_ms']:.3f} + "
          f"{t['rans_decode_ms']:.3f}; {t['rans_over_copy']:.1f}x the copy, {t['rans_over_q4']:.1f}x q4's "
          f"encode + decode, {t['rans_mvalues_per_s']:.0f} M values/s)")
    print(f"  this tensor: H = {t['entropy_bits_per_value']:.2f} bits/value, packed {t['packed_bytes']} B -> rANS "
          f"{t['rans_bytes']} B ({t['ratio']:.2f}x)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="smoke test: scikit-learn digits, 6 steps (seconds)")
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--codecs", nargs="+", default=None, help=f"quantizers (default {' '.join(CODECS)})")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--p", type=float, default=0.5, help="lazy sampling: probability of a fresh batch per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats of the cost measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and CSV")
    args = parser.parse_args(argv)

    try:
        import constriction  # noqa: F401
    except ImportError:
        sys.exit("entropy_coding.py needs constriction: pip install constriction==0.5.0")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.empty(30 << 18)  # as codec_speed.py: let glibc reach its steady state for large blocks before timing
    started = time.perf_counter()
    if args.tiny:
        tasks, codecs, steps, values, warmup, repeats = ["digits"], args.codecs or TINY_CODECS, 6, 1 << 16, 1, 3
    else:
        tasks, codecs, steps = args.tasks, args.codecs or CODECS, args.steps
        values, warmup, repeats = TIMED_VALUES, 3, args.repeats
    for spec in codecs:
        codec = get_codec(spec)
        if not isinstance(codec, QuantCodec) or codec.bits < 2 or codec.scale != "channel" or codec.stochastic:
            parser.error(f"{spec}: only per-channel round-to-nearest quantizers q2..q8 (optionally :fp16)")

    info = describe(torch_threads=torch.get_num_threads())
    from importlib.metadata import version

    info["constriction"] = version("constriction")
    print(f"CPU: {info['cpu']} ({info['logical_cpus']} logical CPUs) | torch {info['torch']} | "
          f"{info['torch_threads']} thread(s) | constriction {info.get('constriction')}")

    rows, runs, skipped, stash, source = [], [], {}, None, None
    for name in tasks:
        reason = missing(name)
        if reason:
            print(f"skipping {name}: {reason}")
            skipped[name] = reason
            continue
        task_rows, run, task_stash = run_task(name, steps, args.p, codecs, args.seed, stash_rows=8)
        rows += task_rows
        runs.append(run)
        stash, source = task_stash, f"{name} {run['cuts'][0]}"  # the last task's
        print(f"{name}: {steps} steps ({run['fresh_steps']} fresh), loss {run['loss_first']:.3f} -> "
              f"{run['loss_last']:.3f}; training {run['train_s']:.1f} s, coding {run['codec_s']:.1f} s; "
              f"message shapes {run['message_shapes']}")
    if not rows:
        sys.exit("no task could run: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))

    print("\nPer step, summed over the step's micro-batch messages. packed B: the codec's payload; H b/v: entropy of\n"
          "the codes; rANS b/v: coded codes alone; ratio = packed / (rANS + histogram + scales), mean over steps,\n"
          "then over fresh and reuse steps; best: each message sent the smaller way (packed or rANS); ideal =\n"
          "packed / (scales + n*H/8). fc: Clapping-FC differences (step 0, sent in full, left out); direct: the\n"
          "value itself.\n")
    order = {k: i for i, k in enumerate(KINDS)}
    rows.sort(key=lambda r: (tasks.index(r["task"]), r["cut"], order[r["kind"]], codecs.index(r["codec"])))
    print_table(rows)
    timing = {"source": f"activations at {source}, last steps", **time_codecs(stash, values, warmup, repeats)}
    print_timing(timing)
    elapsed = time.perf_counter() - started
    print(f"\ntotal {elapsed:.0f} s")

    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"mode": "tiny" if args.tiny else "default", "tasks": tasks, "codecs": codecs, "steps": steps,
                "p": args.p, "seed": args.seed, "timed_values": values, "elapsed_s": elapsed,
                "model_cost": "2L+1 uint32 counts per message", "skipped": skipped}
    (args.out / "entropy_coding.json").write_text(
        json.dumps({"machine": info, "settings": settings, "runs": runs, "rows": rows, "timing": timing}, indent=2))
    flat = [{k: v for k, v in r.items() if k not in ("ratio_per_step", "fresh_per_step")} for r in rows]
    with open(args.out / "entropy_coding.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    print(f"wrote {args.out / 'entropy_coding.json'} and {args.out / 'entropy_coding.csv'}")


if __name__ == "__main__":
    main()
