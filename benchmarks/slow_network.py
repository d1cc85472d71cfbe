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
``--fu-p`` without values), default (400 steps). ``--bottleneck N:FWD/BWD[:VARIANT]`` adds a model change: a
trainable ``lightning_clapping.Bottleneck`` of width d/N before every cut (the cut between its halves), with direct
compression of its code (label ``direct bnN FWD/BWD``) or under ``clapping-fc``/``clapping-fu`` at ``--p`` (label
``clapping-fc p=P bnN FWD/BWD``). ``--schedule gpipe`` runs every setting with GPipe instead of 1F1B.
``--loopback-only`` runs every variant on loopback and no shaped link (``benchmarks/time_to_target.py`` takes the loss
trajectories from it). A run with autotune records what it chose per boundary (``autotune_choice``).

Results: ``STEM.json`` (everything, per step), ``.csv`` (one row per run) and ``.png`` under ``--out``, STEM being
``--stem`` or ``slow_network`` + ``_delay`` (a link with delay) + ``_quick`` (quick mode), so quick and delayed runs do
not overwrite the full run's files; ``--validate-only`` writes ``slow_network_links.json`` (under ``--out``, default a
temp folder).

Code: this file reads the options and runs the plan; ``_slow_network_settings.py`` holds the links, modes and
variants, ``_slow_network_links.py`` sets up and checks the links, ``_slow_network_launch.py`` starts the ranks and
cleans up, ``_slow_network_worker.py`` is what one rank runs, ``_slow_network_report.py`` the analysis, the tables,
the plot and the results files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _netns import Lab, NetnsError, delay_unavailable_reason, unavailable_reason  # noqa: E402
from _slow_network_launch import Runner, clean_up_at_exit  # noqa: E402
from _slow_network_links import (  # noqa: E402
    build_links, check_link, check_summary, configure_link, print_link_checks, relay_summary, shaping_text)
from _slow_network_report import (  # noqa: E402
    DELAY_FLOOR_BOUND, add_comparisons, evaluate_targets, first_to_target, machine, print_report, print_run,
    summarize, write_link_checks, write_results)
from _slow_network_settings import (  # noqa: E402
    ROOT, LinkSpec, MiB, Mode, Variant, check_variant_codecs, fp32_message_bytes, loopback_variants, make_mode,
    make_variants, output_stem, parse_link, parse_sites, strategy_accepts)

#: one run of the plan: a link (None: loopback, the communication-free limit) and a variant
Run = tuple[LinkSpec | None, Variant]


class _Parser(argparse.ArgumentParser):
    """Reads a per-boundary codec list that starts with an uncompressed boundary (``-,q4,-/-,q8,-``) as a value:
    argparse would take any word that starts with ``-`` for an unknown option."""

    def _parse_optional(self, arg_string):
        if arg_string.startswith(("-,", "-/")):
            return None
        return super()._parse_optional(arg_string)



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    ap.add_argument("--bottleneck", nargs="*", default=[], metavar="N:FWD/BWD[:VARIANT]",
                    help="also run a model with a trainable Bottleneck of width d/N before every cut (a model "
                         "change; lightning_clapping.Bottleneck), its code compressed directly or under VARIANT "
                         "(clapping-fc, clapping-fu, at --p), e.g. 8:q8/q8 8:q4/q8:clapping-fc")
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
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from _slow_network_worker import worker  # the rank's side: only the ranks import torch

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
    cuts = split_cuts(mode)
    info = machine()
    settings = run_settings(mode, args, cuts, variants, loop_variants)
    print_plan(info, settings, mode, args, variants, loop_variants, out / stem)

    t_all = time.monotonic()
    plan: list[Run] = [(None, v) for v in loop_variants] + [(link, v) for link in mode.links for v in variants]
    rows, checks = run_plan(plan, mode, args, worker_config(mode, args, cuts))
    add_comparisons(rows)
    targets, ranking = evaluate_targets(rows), first_to_target(rows)
    print("\nlinks as measured before their runs (configured rate and delay against what a ping and a TCP transfer "
          "saw):")
    print_link_checks(checks)
    print()
    print_report(rows, targets, ranking, mode, args.burst)
    info["load_average_at_end"] = list(os.getloadavg())
    info["total_wall_seconds"] = time.monotonic() - t_all
    write_results(out, stem, {"machine": info, "settings": settings, "links": checks, "runs": rows,
                              "targets": targets, "first_to_target": ranking}, mode.links)
    return 1 if any(r["error"] for r in rows) else 0


def split_cuts(mode: Mode) -> list[int]:
    """The blocks that start stages 1, 2, ...: the model's layers shared evenly (at least one per stage)."""
    layers_per_stage = mode.layers // mode.stages or 1
    return [k * layers_per_stage for k in range(1, mode.stages)]


def worker_config(mode: Mode, args: argparse.Namespace, cuts: list[int]) -> dict:
    """What every rank of every run is told (``--worker CONFIG``), less the variant and the run's folder."""
    cfg = {k: getattr(mode, k) for k in ("stages", "d", "heads", "layers", "block", "batch", "microbatches",
                                         "steps", "val_every", "val_batches", "data_limit", "seed")}
    cfg.update(cuts=cuts, threads=args.threads, strategy_timeout=300, schedule=args.schedule)
    return cfg


def run_settings(mode: Mode, args: argparse.Namespace, cuts: list[int], variants: list[Variant],
                 loop_variants: list[Variant]) -> dict:
    """The ``settings`` of the results: everything a run depended on."""
    return dict(asdict(mode), budget=args.budget, burst=args.burst, latency=args.latency,
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


def print_plan(info: dict, settings: dict, mode: Mode, args: argparse.Namespace, variants: list[Variant],
               loop_variants: list[Variant], results: Path) -> None:
    """The machine, the mode, the links and the variants, before the first run."""
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
    print(f"results: {results}.{{json,csv,png}}\n")


def run_plan(plan: list[Run], mode: Mode, args: argparse.Namespace, base_cfg: dict) -> tuple[list[dict], list[dict]]:
    """Every run of the plan in order, each link checked before its first run: the runs' rows and the link checks.
    The namespaces and the relay are gone when it returns, and so are the ranks' logs unless --keep-logs."""
    workdir = Path(tempfile.mkdtemp(prefix="slow_network_"))
    lab = Lab()
    runner = Runner(lab, workdir)
    clean_up_at_exit(runner.close)
    rows: list[dict] = []
    checks: list[dict] = []
    try:
        stage_eps, delay_eps = build_links(lab, mode)
        loop_ep = lab.build_loopback()
        checked = None
        for i, (link, variant) in enumerate(plan):
            if link is not None and link != checked:  # a new link: measure what it really does, before its runs
                checked = link
                checks.append(check_link(lab, link, configure_link(lab, link, args, stage_eps, delay_eps), args))
                print(check_summary(link, checks[-1]))
            # each run on a fresh link: tbf reshaped, or a new relay (its counters then cover this run only)
            endpoints = ([loop_ep] * mode.stages if link is None
                         else configure_link(lab, link, args, stage_eps, delay_eps))
            name = "loopback" if link is None else link.key
            print(f"[{i + 1}/{len(plan)}] {name:<14} {variant.label:<24} ...", end=" ", flush=True)
            key = f"{i:02d}_{name}_{variant.label.replace(' ', '_').replace('=', '')}"
            cfg = run_config(base_cfg, mode, args.budget, variant)
            timeout = run_timeout(mode, link, args.budget)
            rows.append(measured_run(lab, runner, key, cfg, endpoints, timeout, mode, link, variant))
    finally:
        runner.close()
        if args.keep_logs:
            print(f"per-rank logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows, checks


def run_config(base_cfg: dict, mode: Mode, budget: float, variant: Variant) -> dict:
    """A run's worker config: the variant, and with --budget the compressed variants' own number of steps."""
    cfg = dict(base_cfg, variant=asdict(variant))
    if variant.variant != "uncompressed" and budget != 1.0:
        cfg["steps"] = max(mode.val_every, round(mode.steps * budget / mode.val_every) * mode.val_every)
    return cfg


def run_timeout(mode: Mode, link: LinkSpec | None, budget: float) -> float:
    """A generous bound on a run's wall time: start-up, and every step and validation batch at the fp32 wire time
    of the busiest link, the waits of a delayed link and some compute."""
    fp32 = fp32_message_bytes(mode)
    wire = 0.0 if link is None else 2 * fp32 * 8 / (link.rate_mbit * 1e6)  # busiest link, fp32, per step
    # a delayed link: at most one wait per micro-batch, boundary and direction (a generous bound)
    lag = 0.0 if link is None else 2 * (mode.stages - 1) * (mode.microbatches + 2) * (link.delay_ms or 0) / 1e3
    n_steps = max(mode.steps, round(mode.steps * budget))
    n_vals = n_steps // mode.val_every
    return 180 + 4 * (n_steps * (wire + lag + 0.6) + n_vals * mode.val_batches * (wire / 2 + lag + 0.3))


def measured_run(lab: Lab, runner: Runner, key: str, cfg: dict, endpoints: list, timeout: float, mode: Mode,
                 link: LinkSpec | None, variant: Variant) -> dict:
    """One run, summarised with what the link's counters, the relay and the machine's load did meanwhile; prints
    how it went."""
    before = None if link is None else lab.counters(endpoints)
    load_before = os.getloadavg()[0]
    relayed = link is not None and link.delay_ms is not None
    relay_cpu0 = (lab.relay_stats() or {}).get("cpu_s") if relayed else None
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
    print_run(row, raw)
    return row


def validate_only(mode: Mode, args: argparse.Namespace) -> int:
    """Build the links, measure each against its configuration, print the table, save it, tear down. Exit 1 if a
    link is off its configuration."""
    out = args.out or Path(tempfile.gettempdir()) / "slow_network_links"
    print(f"links: {'; '.join(f'{x.label} ({shaping_text(x, args)})' for x in mode.links)}; "
          f"{mode.stages} stage namespaces")
    t0 = time.monotonic()
    lab = Lab()
    clean_up_at_exit(lab.teardown)
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
    settings = {"burst": args.burst, "latency": args.latency, "stages": mode.stages,
                "sites": None if args.sites is None else list(args.sites), "links": [asdict(x) for x in mode.links]}
    write_link_checks(out, settings, checks, time.monotonic() - t0)
    return 0 if all(c["verdict"] == "ok" for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
