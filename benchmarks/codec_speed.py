"""Codec speed: encode+decode throughput of every codec against a plain memory copy of the same tensor.

    python benchmarks/codec_speed.py [--quick | --tiny | --payloads-only] [--threads N] [--hot-cache]
                                     [--shapes 2048x512 ...] [--stem codec_speed] [--out benchmarks/results]

Each codec runs on fp32 activations shaped like a pipeline message, ``[batch*seq, hidden]``: (2048, 512) and
(8192, 512), i.e. 1 M and 4 M values. Every repeat of one loop times ``y.copy_(x)``, ``encode``, ``decode`` (into a
new tensor) and ``decode_into`` (into a reused buffer), each after flushing the CPU caches, so the copy baseline and
the codec start from the same machine state. The headline is the ratio of median times, memory copy over
encode + decode (= codec throughput / copy throughput); absolute times are printed for context, they drift between
runs on a shared machine.

Where numba is installed, ``q2``, ``q4`` and ``q8`` (per-channel) run the fused CPU kernels
(``lightning_clapping/codecs/fused_cpu.py``) on these shapes (``:sr`` decodes with them; it encodes eagerly); each of
those codecs then gets a second row, ``path`` ``eager``, timed in the same loop with the kernels turned off (the code
that runs without numba). The two paths write the same bytes.

``--threads`` (default 1) sets torch's intra-op threads: a pipeline stage process gets one thread when several
stages share a small CPU. ``--tiny`` is a smoke test (small tensors, 2 repeats). Results go to ``codec_speed.json``
and ``codec_speed.csv`` under ``--out``, with a description of the machine.

Every run also prints (and stores under ``"payloads"`` in the JSON) the bytes of the quantizers with float32 and
fp16 scales at two message shapes of the project's benchmarks, computed, not timed: ``payload_nbytes`` of the codec
and the whole data message (``lightning_clapping.comm.wire.message_nbytes``: header, shape and alignment included),
each against the same tensor sent as float32. ``--payloads-only`` prints just that table.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning_clapping.comm.wire import message_nbytes  # noqa: E402
from lightning_clapping.codecs import compression_ratio, fused_cpu, get_codec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe  # noqa: E402
from _table import table  # noqa: E402

CODECS = ["identity", "bf16", "fp16", "fp8", "q8", "q4", "q2", "q4:group128", "q4:sr", "q4:fp16", "q8:fp16",
          "topk:0.1", "topk:0.1+q8", "randk:0.1", "randk:0.1+q4"]
HEADLINE = "q4"
# Message shapes of the benchmarks: a 16 x 256 MLP activation, and the character transformer's activation
# (context 128, width 128) for a whole batch of 32 and for one micro-batch of 4 (BENCHMARKS.md section 1 splits the
# batch of 32 into 8 micro-batches: each message is 4 x 128 x 128).
PAYLOAD_SHAPES = [(16, 256), (32, 128, 128), (4, 128, 128)]
PAYLOAD_CODECS = ["q4", "q4:fp16", "q8", "q8:fp16", "topk:0.1", "topk:0.1+q8", "randk:0.1", "randk:0.1+q4"]


def payload_rows(shapes=PAYLOAD_SHAPES, specs=PAYLOAD_CODECS) -> list[dict]:
    """Bytes on the wire per codec and shape: the payload and the whole message, each against float32."""
    rows = []
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        fp32_message = message_nbytes([(shape, 4 * n)])
        for spec in specs:
            payload = get_codec(spec).payload_nbytes(shape, torch.float32)
            message = message_nbytes([(shape, payload)])
            rows.append({"shape": "x".join(map(str, shape)), "codec": spec, "fp32_payload_bytes": 4 * n,
                         "payload_bytes": payload, "payload_ratio": 4 * n / payload,
                         "fp32_message_bytes": fp32_message, "message_bytes": message,
                         "message_ratio": fp32_message / message})
    return rows


def print_payloads(rows: list[dict]) -> None:
    print(table([(r["shape"], r["codec"], r["fp32_payload_bytes"], r["payload_bytes"], f"{r['payload_ratio']:.2f}x",
                  r["fp32_message_bytes"], r["message_bytes"], f"{r['message_ratio']:.2f}x") for r in rows],
                ["shape", "codec", "fp32 B", "payload B", "ratio", "fp32 msg B", "msg B", "ratio"],
                colalign=("right", "left") + ("right",) * 6))


def machine() -> dict:
    try:
        import numba

        numba_version = numba.__version__
    except ImportError:
        numba_version = None
    return describe(torch_threads=torch.get_num_threads(), numba=numba_version)


class CacheFlush:
    """Writes a 96 MB buffer (several times a last-level cache), so the next timed operation starts from memory."""

    def __init__(self, enabled: bool, megabytes: int = 96):
        self.buffer = torch.empty(megabytes << 18) if enabled else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(1.0)


def runs_fused(spec: str, shape: tuple[int, ...]) -> bool:
    """Whether the codec encodes or decodes with the fused kernels at that shape (``q4:sr`` only decodes so)."""
    codec, x = get_codec(spec), torch.empty(shape)
    return hasattr(codec, "runs_fused") and (codec.runs_fused(x) or codec.runs_fused(x, decoding=True))


def measure(spec: str, shape: tuple[int, ...], warmup: int, repeats: int, flush: CacheFlush, eager: bool) -> dict:
    """One row; ``eager``: with the fused CPU kernels turned off."""
    with fused_cpu.eager() if eager else contextlib.nullcontext():
        path = "eager" if eager or not runs_fused(spec, shape) else "fused"
        return _measure(spec, shape, warmup, repeats, flush, path)


def _measure(spec: str, shape: tuple[int, ...], warmup: int, repeats: int, flush: CacheFlush, path: str) -> dict:
    codec = get_codec(spec)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    y = torch.empty_like(x)
    received = torch.empty_like(x)  # a receive buffer reused every step, for decode_into
    error = float((codec.decode(codec.encode(x), x.shape, x.dtype) - x).norm() / x.norm())
    times = {"copy": [], "encode": [], "decode": [], "decode_into": []}
    for step in range(warmup + repeats):
        flush()
        t0 = time.perf_counter()
        y.copy_(x)
        t1 = time.perf_counter()
        flush()
        t2 = time.perf_counter()
        payload = codec.encode(x, seed=step)
        t3 = time.perf_counter()
        flush()
        t4 = time.perf_counter()
        decoded = codec.decode(payload, x.shape, x.dtype, seed=step)
        t5 = time.perf_counter()
        flush()
        t6 = time.perf_counter()
        codec.decode_into(payload, received, seed=step)
        t7 = time.perf_counter()
        del payload, decoded  # as a training loop would, before the next message
        if step >= warmup:
            for key, seconds in zip(times, (t1 - t0, t3 - t2, t5 - t4, t7 - t6)):
                times[key].append(seconds)
    med = {key: statistics.median(values) for key, values in times.items()}
    round_trip = statistics.median(e + d for e, d in zip(times["encode"], times["decode"]))
    round_trip_into = statistics.median(e + d for e, d in zip(times["encode"], times["decode_into"]))
    fp32_bytes = 4 * x.numel()
    return {
        "codec": spec,
        "path": path,
        "shape": "x".join(map(str, shape)),
        "values": x.numel(),
        "payload_bytes": codec.payload_nbytes(x.shape, x.dtype),
        "compression_vs_fp32": compression_ratio(codec, x.shape),
        "copy_ms": 1e3 * med["copy"],
        "encode_ms": 1e3 * med["encode"],
        "decode_ms": 1e3 * med["decode"],
        "decode_into_ms": 1e3 * med["decode_into"],
        "encode_decode_ms": 1e3 * round_trip,
        "encode_decode_gbps": fp32_bytes / round_trip / 1e9,
        "copy_gbps": fp32_bytes / med["copy"] / 1e9,
        "ratio_to_copy": med["copy"] / round_trip,
        "ratio_to_copy_decode_into": med["copy"] / round_trip_into,
        "relative_error": error,
        "repeats": repeats,
    }


def print_table(rows: list[dict]) -> None:
    print(table([(r["shape"], r["codec"], r["path"], f"{r['compression_vs_fp32']:.1f}x", r["copy_ms"], r["encode_ms"],
                  r["decode_ms"], r["decode_into_ms"], r["encode_decode_gbps"], r["ratio_to_copy"],
                  r["ratio_to_copy_decode_into"], r["relative_error"]) for r in rows],
                ["shape", "codec", "path", "compr", "copy ms", "enc ms", "dec ms", "into ms", "GB/s", "vs copy",
                 "(into)", "rel err"],
                floatfmt=(None, None, None, None, ".3f", ".3f", ".3f", ".3f", ".2f", ".3f", ".3f", ".1e"),
                colalign=("right", "left", "left") + ("right",) * 9))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repeats (under a minute)")
    size.add_argument("--tiny", action="store_true", help="smoke test: small tensors, 2 repeats (a few seconds)")
    size.add_argument("--payloads-only", action="store_true",
                      help="print the payload table (bytes per codec and message shape) and time nothing")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and CSV")
    parser.add_argument("--codecs", nargs="+", default=CODECS, help="codec names to measure")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="ROWSxCOLS",
                        help="message shapes to time instead of the mode's (e.g. 16x512 to see the fixed cost)")
    parser.add_argument("--stem", default="codec_speed", help="file name stem of the JSON and CSV under --out")
    parser.add_argument("--hot-cache", action="store_true",
                        help="do not flush the CPU caches before each timed operation (by default every copy, encode "
                             "and decode starts with its input in memory, not in cache)")
    args = parser.parse_args(argv)

    payloads = payload_rows()
    if args.payloads_only:
        print_payloads(payloads)
        return
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.tiny:
        shapes, warmup, repeats = [(64, 64)], 1, 2
    elif args.quick:
        shapes, warmup, repeats = [(2048, 512), (8192, 512)], 5, 10
    else:
        shapes, warmup, repeats = [(2048, 512), (8192, 512)], 5, 30
    if args.shapes:
        shapes = [tuple(int(d) for d in s.lower().split("x")) for s in args.shapes]

    # glibc maps every large block afresh (page faults on each first touch) until a large block has been freed once;
    # a training process has long passed that point, so reach it here before timing anything.
    torch.empty(30 << 18)  # 30 MB, allocated and freed at once
    info = machine()
    print(f"CPU: {info['cpu']} ({info['logical_cpus']} logical CPUs) | torch {info['torch']} | "
          f"{info['torch_threads']} intra-op thread(s) | Python {info['python']}")
    print(f"{warmup} warm-up + {repeats} timed repeats per row, times are medians. 'vs copy' = time of y.copy_(x) /\n"
          f"time of encode + decode, timed in the same loop; '(into)' decodes into a reused buffer (decode_into)\n"
          f"instead of a new tensor. GB/s = fp32 input bytes / (encode + decode) time. CPU caches are\n"
          f"{'left as they are' if args.hot_cache else 'flushed before each timed operation'}.\n")

    flush = CacheFlush(enabled=not args.hot_cache)
    rows = []
    for shape in shapes:
        for spec in args.codecs:
            rows.append(measure(spec, shape, warmup, repeats, flush, eager=False))
            if rows[-1]["path"] == "fused":
                rows.append(measure(spec, shape, warmup, repeats, flush, eager=True))
    print_table(rows)
    for r in rows:
        if r["codec"] == HEADLINE:
            print(f"\n{HEADLINE} (per-channel, {r['path']}) on {r['shape']}: encode+decode at {r['ratio_to_copy']:.2f} "
                  f"of memory-copy throughput ({r['encode_decode_gbps']:.2f} vs {r['copy_gbps']:.2f} GB/s of fp32 input); "
                  f"{r['ratio_to_copy_decode_into']:.2f} decoding into a reused buffer", end="")
    print("\n\nBytes on the wire (computed): payload and whole message against the same tensor in float32\n")
    print_payloads(payloads)

    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"warmup": warmup, "repeats": repeats, "shapes": ["x".join(map(str, s)) for s in shapes],
                "mode": "tiny" if args.tiny else "quick" if args.quick else "full", "cache_flushed": not args.hot_cache}
    json_path, csv_path = args.out / f"{args.stem}.json", args.out / f"{args.stem}.csv"
    result = {"machine": info, "settings": settings, "rows": rows, "payloads": payloads}
    json_path.write_text(json.dumps(result, indent=2))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {json_path} and {csv_path}")


if __name__ == "__main__":
    main()
