"""Time to target of the replica sync modes on the DiLoCoX layout: two sites joined by a slow wide-area link.

    python benchmarks/replica_sync_slow.py [--links 10@25 25@25 100@25] [--all-slow] [--out benchmarks/results]
    python benchmarks/replica_sync_slow.py --tiny                  (smoke test: one link, 2 settings, a few steps)

Needs root (network namespaces, TUN devices); without it the script says why and exits 0 without running anything.

Layout: 2 replicas x 2 stages = 4 ranks (global rank = replica * 2 + (1 - stage): rank 0 runs the last stage of
replica 0, ``lightning_clapping.comm.placement.Topology.rank``). Site A holds replica 0 (ranks 0 and 1), site B
replica 1 (ranks 2 and 3): the pipeline of a replica stays inside its site, on a fast LAN (packets pass at once); only
the replica sync (each stage's ranks 0 <-> 2 and 1 <-> 3) crosses the slow link between the sites. ``--all-slow`` also
runs the layout where every rank is its own site, so the pipeline's activations and gradients cross the slow link
too. Each rank runs in its own network namespace; the links are ``_netns.Lab``'s delay star (a TUN device per rank and
the user-space relay of ``_delay_link.py``: this kernel has no netem) with per-rank sites. The relay's rate is per
sender: each rank has its own uplink of the configured rate to the other site (so a site's two ranks together may
send at twice the rate), with the configured one-way delay and a ``--latency`` queue bound. Before its runs each link is
checked with ``_slow_network_links.check_link`` (UDP echo: RTT = 2 x delay; 2 s TCP transfer: the rate; with sites,
also a pair within one site: no delay, no limit); the table is printed and saved.

Model and data (``--task``): ``_quality_tasks.TASKS["shakespeare"]`` (the default: examples/char_lm.py's
CharTransformer d=128, 4 heads, 4 blocks, context 128, AdamW 1e-3 with 20 warm-up steps, gradient clipping 1.0, batch
32 per replica, 8 micro-batches, 1F1B) cut at ``blocks.2`` (2 blocks per stage, as ``benchmarks/replica_sync.py``), or
``TASKS["wordnet_minilm"]`` (the pretrained all-MiniLM-L6-v2 fine-tuned on WordNet supersenses, AdamW 1e-4, batch 32
per replica, 4 micro-batches) cut at ``encoder.encoder.layer.3``: its stage 0 holds 17.2 M parameters (the token
embedding), so every-step's averaging is 69 MB per step against 3 MB of activations. Each replica trains on its own
half of the data. Each rank uses one CPU thread. The target is a validation loss on either task.

Settings (``replica_sync=``, those of ``benchmarks/replica_sync.py`` that stayed within tolerance there): every-step,
``DiLoCo(inner_steps=H)``, ``DiLoCo(inner_steps=H, codec="q4")`` and clapping-fc q4/q8 + that DiLoCo (H = 16 by
default), the last two with plain averaging as the outer step (``... avg q4``: outer lr 1, no momentum), and
``DiLoCo(..., overlap=H // 4)`` (streaming DiLoCo's overlap: the sync runs beside H/4 inner steps) with either outer
step. The pipeline is uncompressed ("identity" codecs) except in the clapping-fc settings.

Time to target, as ``benchmarks/time_to_target.py`` does it (the arithmetic of a run does not depend on the link):

1. steps to target, on loopback (all ranks in one namespace, no shaping): every-step trains ``--steps`` steps
   (default 128) with a validation every ``--val-every`` steps (default H = 8, so every DiLoCo validation follows an
   outer step) on a fixed subset of the held-out plays (``--eval-samples`` windows, split between the replicas by
   the distributed sampler; the loss is rank 0's, i.e. replica 0's half). The target is every-step's validation
   loss at its last step. Every other setting trains up to ``--budget`` (2) x the steps and stops at its first
   validation at or below the target (rank 0's decision on every rank); its steps to target are that step, or
   "not reached".
2. step times, on each link of each layout: a short run of every setting, 3 x H steps (``--skip`` H + 2 x H); the
   mean step time (rank 0's wall time from ``on_train_batch_start`` to ``on_train_batch_end``, which includes the
   replica sync and DiLoCo's outer step) over the last 2 x H steps. The mean and not the median: a DiLoCo sync step
   is slower than its local steps, and the window holds exactly two of them (steps 2H and 3H). The first H steps stay
   out: the first outer step (step H) carries one-time costs (the first use of the pseudo-gradient codec and the outer
   optimizer: 26 s in a --tiny run on a loaded 2-core machine, against 2-5 s for the later ones), reported on their
   own as ``first_sync_step_s`` and, as warm-up in time_to_target.py, not in the time to target. The mean of the
   timed sync steps alone is reported too (``sync step s``). With ``--baseline-steps N`` every-step's timing runs are
   N steps and its mean is over the steps after ``--baseline-skip`` (2): its steps all cost the same, and on the
   fine-tuning task one takes 27 s at 25 Mbit/s and 63 s at 10.

Time to target = steps to target x mean step time on that link; the report gives every-step's time / the setting's
(``x every-step``, > 1: faster than every-step), and the loopback step of each setting (the compute-only limit).
Bytes: the strategy's ``byte_totals`` (replica sync bytes per step, all ranks) and the relay's own counters of what
crossed between sites (``relay_wire_bytes``) and stayed inside one (``relay_lan_bytes``), per step of the timing run.

Cost on 2 idle cores (the script prints its estimate at start): with the defaults (3 links, sites layout) about
35 minutes, most of it the loopback trajectories (128 steps of every-step, up to 256 of each other setting;
early stop shortens those that reach the target); ``--all-slow`` adds about 20 minutes of timing runs. Timings need an
otherwise idle machine: every run records the CPU cores other processes used meanwhile (``other_cores``; warned above
0.2).

Results under ``--out`` (default ``benchmarks/results``; ``--tiny``: a temp folder): ``STEM.json`` (settings, machine,
link checks, every run, the combined rows), ``STEM.png`` (time to target against the link rate, one panel per
layout) unless matplotlib is missing, and the table printed. STEM is ``--stem`` (default ``replica_sync_slow``).

Code: this file is the launcher (it never imports torch); ``_replica_sync_slow_worker.py`` is what one rank runs.
Reused: ``_netns.Lab`` and ``_delay_link`` (namespaces, TUN devices, relay), ``_slow_network_links`` (link set-up,
checks, their table), ``_slow_network_launch.Runner`` (starting the ranks in their namespaces with torchrun's
environment, clean-up at exit, the load of other processes), ``_slow_network_worker.Recorder`` (per-step timings),
``time_to_target.steps_to_target`` and ``_slow_network_report.machine``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _slow_network_launch  # noqa: E402
from _netns import Lab, NetnsError, delay_unavailable_reason  # noqa: E402
from _slow_network_launch import Runner, clean_up_at_exit  # noqa: E402
from _slow_network_links import check_link, check_summary, configure_link, print_link_checks, relay_summary  # noqa: E402
from _slow_network_report import _fmt, machine  # noqa: E402
from _slow_network_settings import LinkSpec, parse_link  # noqa: E402
from _replica_sync_slow_report import LAYOUT_TEXT, _slug, combine, print_table, write_results  # noqa: E402

#: --task -> where it is cut (2 stages, as benchmarks/replica_sync.py cuts it), rough numbers for the estimate and
#: the run timeouts (2 idle cores, 4 ranks of one thread), and the line the script prints
SLOW_TASKS: dict[str, dict] = {
    "shakespeare": dict(
        split_points=["blocks.2"],
        loopback_step_s=0.9,  # 2 blocks per rank, batch 32 per replica, 8 micro-batches; 2 replicas on 2 cores
        stage_grad_bytes=423_680 * 4,  # fp32 gradient of stage 0 (the larger): what every-step all-reduces per step
        pipe_bytes=32 * 128 * 128 * 4,  # one boundary message per step and direction, fp32
        text="Shakespeare char-LM (TASKS['shakespeare']: d=128, 4 blocks, context 128, batch 32 per replica, 8 "
             "micro-batches, clip 1.0) cut at blocks.2: 2 stages x 2 replicas = 4 ranks, one thread each"),
    "wordnet_minilm": dict(
        split_points=["encoder.encoder.layer.3"],
        loopback_step_s=1.4,  # measured: 1.41 s every-step, 1.19 s DiLoCo (3 layers per rank, 4 micro-batches)
        stage_grad_bytes=17_241_984 * 4,  # stage 0: the 30,522 x 384 token embedding and layers 0-2
        pipe_bytes=32 * 32 * 384 * 4,
        text="WordNet supersenses, the pretrained all-MiniLM-L6-v2 fine-tuned (TASKS['wordnet_minilm']: 6 layers, "
             "width 384, 32 tokens, batch 32 per replica, 4 micro-batches, AdamW 1e-4) cut at "
             "encoder.encoder.layer.3: 2 stages x 2 replicas = 4 ranks, one thread each"),
}
STAGES, REPLICAS = 2, 2
WORLD = STAGES * REPLICAS
BASELINE = "every-step"
DEFAULT_LINKS = ["10@25", "25@25", "100@25"]
#: layout -> the site of each global rank (None: every rank its own site, every packet crosses the slow link)
LAYOUTS: dict[str, tuple[int, ...] | None] = {"sites": (0, 0, 1, 1), "all-slow": None}
AVG = {"outer_lr": 1.0, "momentum": 0.0}  # DiLoCo with plain averaging as the outer step
FC_Q4Q8 = {"variant": "clapping-fc", "forward_codec": "q4", "backward_codec": "q8"}  # Clapping-FC on the pipeline
TINY = dict(links=["25@25"], inner_steps=2, steps=4, val_every=2, data_limit=256, eval_samples=64,
            settings=[BASELINE, "clapping-fc q4/q8 + diloco H=2 q4"])


def make_settings(h: int) -> dict[str, dict]:
    """label -> ClappingStrategy arguments as plain JSON (the worker resolves ``replica_sync``); the labels and
    arguments of benchmarks/replica_sync.py's CONFIGS with H = ``h``."""
    diloco = {"mode": "diloco", "inner_steps": h}
    return {
        BASELINE: {},
        f"diloco H={h}": {"replica_sync": diloco},
        f"diloco H={h} q4": {"replica_sync": dict(diloco, codec="q4")},
        f"clapping-fc q4/q8 + diloco H={h} q4": {"replica_sync": dict(diloco, codec="q4"), **FC_Q4Q8},
        # plain averaging as the outer step (outer lr 1, no momentum), as replica_sync.py's "... avg q4"
        f"diloco H={h} avg q4": {"replica_sync": dict(diloco, codec="q4", **AVG)},
        f"clapping-fc q4/q8 + diloco H={h} avg q4": {"replica_sync": dict(diloco, codec="q4", **AVG), **FC_Q4Q8},
        # streaming DiLoCo's overlap: each sync's collective runs beside H/4 more inner steps
        f"diloco H={h} q4 overlap {h // 4}": {"replica_sync": dict(diloco, codec="q4", overlap=h // 4)},
        f"diloco H={h} avg q4 overlap {h // 4}": {"replica_sync": dict(diloco, codec="q4", overlap=h // 4, **AVG)},
    }


def inner_steps_of(setting: dict) -> int | None:
    sync = setting.get("replica_sync")
    return sync.get("inner_steps") if isinstance(sync, dict) and sync.get("mode") == "diloco" else None


def layout_link(link: LinkSpec, layout: str) -> LinkSpec:
    """``link`` with the layout's sites, as ``configure_link`` and ``check_link`` take them: their ``sites`` are per
    pipeline stage of one replica and reversed into per-endpoint order (``endpoint_sites``), so the per-rank list is
    given reversed here and endpoint (= global rank) ``i`` gets ``LAYOUTS[layout][i]``."""
    sites = LAYOUTS[layout]
    return LinkSpec(link.rate_mbit, link.delay_ms, None if sites is None else tuple(reversed(sites)))


def link_label(link: LinkSpec) -> str:
    return f"{link.rate_mbit:g} Mbit/s {link.delay_ms:g} ms"


def stage_of(rank: int) -> int:
    return STAGES - 1 - rank % STAGES


# ====================================================================================================================
# Options and the estimate
# ====================================================================================================================


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", nargs="+", default=None, metavar="RATE@DELAY",
                    help=f"slow links between sites, Mbit/s @ one-way ms (default {' '.join(DEFAULT_LINKS)}; "
                         "--tiny: 25@25)")
    ap.add_argument("--all-slow", action="store_true",
                    help="also time every setting with every rank in its own site (the pipeline crosses the slow "
                         "link too); the loopback trajectories are shared")
    ap.add_argument("--settings", nargs="+", default=None, metavar="LABEL",
                    help="the settings to run (default: all; every-step is always run, it sets the target)")
    ap.add_argument("--task", choices=list(SLOW_TASKS), default="shakespeare",
                    help="the model and data (default shakespeare; wordnet_minilm: fine-tuning a pretrained model "
                         "whose stage 0 holds 17 M parameters, where the replicas' averaging dominates)")
    ap.add_argument("--inner-steps", type=int, default=16, help="DiLoCo's H (default 16)")
    ap.add_argument("--steps", type=int, default=128, help="every-step's loopback steps; its last loss is the target")
    ap.add_argument("--budget", type=float, default=2.0, help="other settings train up to this many x --steps")
    ap.add_argument("--val-every", type=int, default=None, help="validation spacing on loopback (default H)")
    ap.add_argument("--eval-samples", type=int, default=512,
                    help="held-out windows of the fixed validation subset (split between the replicas)")
    ap.add_argument("--skip", type=int, default=None,
                    help="first steps of a run left out of its mean step (default H: the first outer step, which "
                         "carries one-time costs such as the codecs' first use, stays out of the window)")
    ap.add_argument("--timing-steps", type=int, default=None,
                    help="steps of a timing run (default skip + 2 x H = 3 x H; at least that)")
    ap.add_argument("--baseline-steps", type=int, default=None,
                    help="steps of every-step's timing runs (default: as the others); its steps all cost the same, "
                         "so a few suffice where one takes a minute on a slow link")
    ap.add_argument("--baseline-skip", type=int, default=2,
                    help="with --baseline-steps: its first steps left out of the mean (default 2)")
    ap.add_argument("--data-limit", type=int, default=None, help="training windows (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--latency", default="100ms", help="the relay's queue bound (tail drop), as tbf's latency")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results; --tiny: temp)")
    ap.add_argument("--stem", default="replica_sync_slow")
    ap.add_argument("--keep-logs", action="store_true", help="keep the per-rank logs (their folder is printed)")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test: link 25@25, every-step and clapping-fc + DiLoCo H=2, 4 loopback steps (8 for "
                         "the other), 5 timing steps, 256 training windows")
    ap.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    if args.tiny:
        for key in ("inner_steps", "steps", "val_every", "data_limit", "eval_samples"):
            setattr(args, key, TINY[key])
        args.links = args.links or TINY["links"]
        args.settings = args.settings or TINY["settings"]
    args.links = [parse_link(x) for x in (args.links or DEFAULT_LINKS)]
    if any(x.delay_ms is None for x in args.links):
        raise SystemExit("replica_sync_slow: give every link as RATE@DELAY (the user-space relay with sites), e.g. "
                         "25@25")
    settings = make_settings(args.inner_steps)
    chosen = args.settings or list(settings)
    unknown = [s for s in chosen if s not in settings]
    if unknown:
        raise SystemExit(f"replica_sync_slow: unknown settings {unknown}; known: {list(settings)}")
    args.settings = {k: settings[k] for k in dict.fromkeys([BASELINE, *chosen])}
    args.val_every = args.val_every or args.inner_steps
    args.skip = args.inner_steps if args.skip is None else args.skip
    if args.steps % args.val_every:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --val-every ({args.val_every})")
    args.long_steps = max(args.steps, int(args.steps * args.budget) // args.val_every * args.val_every)
    args.timing_steps = max(args.timing_steps or 0, args.skip + 2 * args.inner_steps)
    if args.baseline_steps is not None and args.baseline_steps <= args.baseline_skip:
        raise SystemExit(f"--baseline-steps ({args.baseline_steps}) must be more than --baseline-skip "
                         f"({args.baseline_skip})")
    args.layouts = ["sites", "all-slow"] if args.all_slow else ["sites"]
    args.out = args.out or (Path(tempfile.gettempdir()) / "replica_sync_slow_tiny" if args.tiny
                            else HERE / "results")
    return args


# rough numbers for the estimate and the run timeouts (2 idle cores, 4 ranks of one thread; per task: SLOW_TASKS)
START_UP_S = 25.0  # processes, rendezvous, data, model
LINK_CHECK_S = 10.0  # relay start, 20 pings and a 2 s TCP transfer, per pair (two with sites)
VAL_BATCH_S = 0.15  # one held-out batch of 64 windows through the pipeline
WIRE_FACTOR = 1.3  # share of the busiest sender's wire time that does not hide (time_to_target.py's fit)
REPLICA_SHARE = {"every-step": 1.0, "lag": 0.6}  # bytes of the replica sync per step against every-step's


def replica_share(label: str, setting: dict) -> float:
    h = inner_steps_of(setting)
    if h is None:
        return REPLICA_SHARE.get(label, 1.0)
    return 1.0 / h / (20.0 if isinstance(setting["replica_sync"], dict) and "codec" in setting["replica_sync"]
                      else 1.0)


def estimate_step_s(task: dict, label: str, setting: dict, link: LinkSpec | None, layout: str) -> float:
    """A step of the busiest rank of ``task`` (a SLOW_TASKS entry): loopback compute, the unhidden wire time of what
    it sends across sites, the round trips of the collectives (and, all-slow, the pipeline's fill and drain)."""
    if link is None:
        return task["loopback_step_s"]
    sent = task["stage_grad_bytes"] * 1.0 * replica_share(label, setting)  # 2 replicas: gloo's ring sends the tensor once
    trips = 4
    if layout == "all-slow":
        fwd, bwd = (1 / 7.5, 1 / 3.8) if setting.get("variant") == "clapping-fc" else (1.0, 1.0)
        sent += task["pipe_bytes"] * max(fwd, bwd)
        trips += 2 * (STAGES - 1) + 2
    return task["loopback_step_s"] + trips * link.delay_ms / 1e3 + WIRE_FACTOR * sent * 8 / (link.rate_mbit * 1e6)


def estimate_seconds(args: argparse.Namespace) -> tuple[float, float]:
    """(loopback trajectories, timing runs) in seconds, at worst (no early stop)."""
    task = SLOW_TASKS[args.task]
    val_s = args.eval_samples / 64 / REPLICAS * VAL_BATCH_S
    traj = 0.0
    for label in args.settings:
        n = args.steps if label == BASELINE else args.long_steps
        traj += START_UP_S + n * task["loopback_step_s"] + n // args.val_every * val_s
    timing = 0.0
    for layout in args.layouts:
        for link in args.links:
            timing += LINK_CHECK_S * (2 if LAYOUTS[layout] else 1)
            for label, setting in args.settings.items():
                timing += START_UP_S + timing_steps(args, label)[0] * estimate_step_s(task, label, setting, link,
                                                                                      layout)
    return traj, timing


def timing_steps(args: argparse.Namespace, label: str) -> tuple[int, int]:
    """(steps, skip) of a setting's timing runs: every-step's from --baseline-steps where given."""
    if label == BASELINE and args.baseline_steps is not None:
        return args.baseline_steps, args.baseline_skip
    return args.timing_steps, args.skip


def run_timeout(steps: int, step_s: float, vals: int, val_batches: float) -> float:
    return 300 + 6 * (steps * step_s + vals * val_batches * VAL_BATCH_S)


# ====================================================================================================================
# Runs
# ====================================================================================================================


def base_config(args: argparse.Namespace) -> dict:
    return {"task": args.task, "split_points": SLOW_TASKS[args.task]["split_points"], "seed": args.seed, "data_limit": args.data_limit,
            "eval_samples": args.eval_samples, "threads": args.threads, "strategy_timeout": 600}


def run_label(i: int, total: int, where: str, label: str) -> None:
    print(f"[{i}/{total}] {where:<34} {label:<44} ...", end=" ", flush=True)


def summarize_run(raw: dict, label: str, setting: dict, skip: int) -> dict:
    """A run's numbers from rank 0 (the last stage of replica 0: it holds the validation loss) and every rank's
    byte totals."""
    row = {"setting": label, "error": raw.get("error"), "warning": raw.get("warning"),
           "wall_seconds": raw["wall_seconds"], "other_cores": raw.get("other_cores")}
    if raw.get("error"):
        row["log_tail"] = raw.get("log_tail")
        return row
    ranks = sorted(raw["ranks"], key=lambda r: r["rank"])
    r0 = ranks[0]
    times = [s["seconds"] for s in r0["steps"]]
    timed = times[skip:] or times
    h = inner_steps_of(setting)
    sync = [s["seconds"] for s in r0["steps"][skip:] if h and s["step"] % h == 0]
    totals = [r["byte_totals"] or {} for r in ranks]
    n = max(1, len(times))
    row.update(
        steps=len(times), global_step=r0["global_step"], stopped_at=r0["stopped_at"],
        mean_step_s=sum(timed) / len(timed) if timed else None,
        median_step_s=sorted(timed)[len(timed) // 2] if timed else None,
        sync_step_s=sum(sync) / len(sync) if sync else None, sync_steps_timed=len(sync),
        first_sync_step_s=next((s["seconds"] for s in r0["steps"] if h and s["step"] == h), None),
        mean_step_s_per_rank=[sum(x["seconds"] for x in r["steps"][skip:]) / max(1, len(r["steps"][skip:]))
                              for r in ranks],
        vals=r0["vals"], final_val_loss=r0["vals"][-1]["val_loss"] if r0["vals"] else None,
        replica_bytes_per_step=sum(t.get("replica_bytes", 0) for t in totals) / n,
        bytes_per_step=sum(t.get("bytes", 0) for t in totals) / n,
        raw_bytes_per_step=sum(t.get("raw_bytes", 0) for t in totals) / n,
        byte_totals=totals, setup_seconds=max(r["setup_seconds"] for r in ranks),
        fit_seconds=max(r["fit_seconds"] for r in ranks), replica_sync=r0["replica_sync"],
        stages_replicas=[r0["num_stages"], r0["replicas"]],
        placement=[{"rank": r["rank"], "stage": r["stage"], "replica": r["replica"]} for r in ranks])
    bad = [r["rank"] for r in ranks if r["stage"] != stage_of(r["rank"]) or r["replica"] != r["rank"] // STAGES]
    if bad:
        row["warning"] = f"ranks {bad} are not where the layout assumes (global rank = replica * 2 + 1 - stage)"
    return row


def print_outcome(row: dict) -> None:
    if row["error"]:
        print(f"FAILED: {row['error']}\n{row.get('log_tail', '')}")
        return
    extra = f", val loss {_fmt(row['final_val_loss'], '.4f')} at step {row['global_step']}" if row["vals"] else ""
    stop = f" (stopped at the target, step {row['stopped_at']})" if row.get("stopped_at") else ""
    print(f"mean step {_fmt(row['mean_step_s'], '.3f')} s, sync step {_fmt(row['sync_step_s'], '.3f')} s, "
          f"replica sync {row['replica_bytes_per_step'] / 1e3:.1f} kB/step{extra}{stop}, {row['wall_seconds']:.0f} s"
          f" wall, other cores {_fmt(row['other_cores'], '.2f')}" + (f"; {row['warning']}" if row["warning"] else ""))


def trajectories(args, runner: Runner, loop_ep, plan_total: int, counter: list[int]) -> tuple[list[dict], float | None]:
    """Phase 1 on loopback: every-step to --steps (its last validation loss is the target), then every other
    setting up to the budget, stopping at the target."""
    rows, target = [], None
    val_batches = args.eval_samples / 64 / REPLICAS
    for label, setting in args.settings.items():
        base = label == BASELINE
        steps = args.steps if base else args.long_steps
        cfg = dict(base_config(args), setting=setting, steps=steps, val_every=args.val_every, val_batches=None,
                   stop_at=None if base else target)
        counter[0] += 1
        run_label(counter[0], plan_total, "loopback (steps to target)", label)
        key = f"{counter[0]:02d}_loopback_{_slug(label)}"
        raw = runner.run(key, cfg, [loop_ep] * WORLD,
                         run_timeout(steps, SLOW_TASKS[args.task]["loopback_step_s"], steps // args.val_every, val_batches))
        row = dict(summarize_run(raw, label, setting, args.skip), kind="trajectory", budget_steps=steps,
                   stop_at=cfg["stop_at"])
        print_outcome(row)
        rows.append(row)
        if base:
            target = None if row["error"] else row["final_val_loss"]
            if target is None:
                print("replica_sync_slow: every-step's loopback run failed: no target; the other settings run their "
                      "whole budget", file=sys.stderr)
            else:
                print(f"target: validation loss {target:.4f} (every-step at step {row['global_step']})")
    return rows, target


def timing_runs(args, lab: Lab, runner: Runner, delay_eps, plan_total: int, counter: list[int]):
    """Phase 2: per layout and link, the link check, then a short run of every setting."""
    rows, checks = [], []
    for layout in args.layouts:
        for link in args.links:
            spec = layout_link(link, layout)
            endpoints = configure_link(lab, spec, args, [], delay_eps)
            check = fix_check(check_link(lab, spec, endpoints, args), link, layout)
            checks.append(check)
            print(check_summary(spec, check).replace(f"link {spec.label}", f"link {check['link']}", 1))
            for label, setting in args.settings.items():
                endpoints = configure_link(lab, spec, args, [], delay_eps)  # a fresh relay: its counters per run
                counter[0] += 1
                where = f"{link_label(link)}, {layout}"
                run_label(counter[0], plan_total, where, label)
                steps, skip = timing_steps(args, label)
                cfg = dict(base_config(args), setting=setting, steps=steps, val_every=steps, val_batches=1,
                           stop_at=None)
                key = f"{counter[0]:02d}_{layout}_{spec.key.split('_sites')[0]}_{_slug(label)}"
                before = lab.counters(endpoints)
                cpu0 = (lab.relay_stats() or {}).get("cpu_s")
                raw = runner.run(key, cfg, endpoints, run_timeout(
                    steps, estimate_step_s(SLOW_TASKS[args.task], label, setting, link, layout), 1, 1))
                counters = Lab.delta(before, lab.counters(endpoints))
                row = dict(summarize_run(raw, label, setting, skip), kind="timing", layout=layout,
                           link=link_label(link), rate_mbit=link.rate_mbit, delay_ms=link.delay_ms,
                           sites=None if LAYOUTS[layout] is None else list(LAYOUTS[layout]))
                row["relay"] = relay_summary(lab.relay_stats())
                if row["relay"] and cpu0 is not None and raw["wall_seconds"] > 0:
                    row["relay_cores"] = max(0.0, row["relay"]["cpu_s"] - cpu0) / raw["wall_seconds"]
                    row["other_cores"] = max(0.0, (row["other_cores"] or 0.0) - row["relay_cores"])
                if not row["error"]:
                    n = max(1, row["steps"])
                    row["relay_wire_bytes_per_step"] = sum(c.get("relay_wire_bytes", 0) for c in counters.values()) / n
                    row["relay_lan_bytes_per_step"] = sum(c.get("relay_lan_bytes", 0) for c in counters.values()) / n
                    row["relay_queue_drops"] = sum(c.get("relay_queue_drops", 0) for c in counters.values())
                row["counters"] = counters
                print_outcome(row)
                rows.append(row)
    return rows, checks


def fix_check(check: dict, link: LinkSpec, layout: str) -> dict:
    """``check_link``'s record in this layout's words: its label, the per-rank sites, and the ranks measured
    (it names stages as if every endpoint were one stage of a single pipeline)."""
    check = dict(check, link=f"{link_label(link)}, {layout}", layout=layout,
                 sites=None if LAYOUTS[layout] is None else list(LAYOUTS[layout]))
    addr = {f"10.77.1.{r + 1}": r for r in range(WORLD)}
    for rec in [check] + ([check["same_site"]] if check.get("same_site") else []):
        for end in ("from", "to"):
            rank = addr.get(rec[end])
            rec[f"{end}_rank"] = rank
            rec[f"{end}_stage"] = None if rank is None else stage_of(rank)
    return check


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from _replica_sync_slow_worker import worker  # the rank's side: only the ranks import torch

        worker(args.worker)
        return 0
    reason = delay_unavailable_reason()
    if reason:
        print(f"replica_sync_slow: skipped, nothing was run: {reason} (run it as root on Linux)", file=sys.stderr)
        return 0
    _slow_network_launch.SCRIPT = Path(__file__).resolve()  # the Runner starts `python SCRIPT --worker CFG`

    info = machine()
    traj_s, timing_s = estimate_seconds(args)
    n_runs = len(args.settings) * (1 + len(args.layouts) * len(args.links))
    print(f"machine: {info['cpu']}, {info['logical_cpus']} logical CPUs, torch {info['torch']}, lightning "
          f"{info['lightning']}, load average {', '.join(f'{x:.2f}' for x in info['load_average_at_start'])}")
    print(f"{SLOW_TASKS[args.task]['text']}; H = {args.inner_steps}; loopback: every-step {args.steps} steps, the others up to "
          f"{args.long_steps} (stop at the target), validation every {args.val_every} steps on {args.eval_samples} "
          f"held-out samples; timing runs: {args.timing_steps} steps, mean over steps > {args.skip}"
          + (f" (every-step: {args.baseline_steps} steps, mean over steps > {args.baseline_skip})"
             if args.baseline_steps is not None else ""))
    print(f"layouts: {'; '.join(f'{x}: {LAYOUT_TEXT[x]}' for x in args.layouts)}")
    print(f"links between sites: {', '.join(link_label(x) for x in args.links)} (relay: rate per sending rank, no "
          f"burst, queue {args.latency})")
    print(f"settings: {', '.join(args.settings)}")
    print(f"estimated duration on 2 idle cores: loopback trajectories up to {traj_s / 60:.0f} min, timing runs "
          f"{timing_s / 60:.0f} min, {(traj_s + timing_s) / 60:.0f} min in all ({n_runs} runs)\n", flush=True)

    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="replica_sync_slow_"))
    lab = Lab(prefix="claprss")
    runner = Runner(lab, workdir)
    clean_up_at_exit(runner.close)
    counter = [0]
    try:
        delay_eps = lab.build_delay_star(WORLD)
        loop_ep = lab.build_loopback()
        traj_rows, target = trajectories(args, runner, loop_ep, n_runs, counter)
        timing_rows, checks = timing_runs(args, lab, runner, delay_eps, n_runs, counter)
    except NetnsError as err:
        print(f"replica_sync_slow: link set-up or measurement failed: {err}", file=sys.stderr)
        return 2
    finally:
        runner.close()
        if args.keep_logs:
            print(f"per-rank logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    rows = combine(timing_rows, traj_rows, target, args)
    print("\nlinks as measured before their runs:")
    print_link_checks(checks)
    print()
    print_table(rows, target)
    busy = [" ".join(x for x in (r.get("layout", "loopback"), r.get("link"), r["setting"]) if x)
            for r in traj_rows + timing_rows if (r.get("other_cores") or 0) > 0.2]
    if busy:
        print(f"\nWARNING: other processes used more than 0.2 CPU cores during {', '.join(busy)}: re-run on a quiet "
              "machine before quoting those times.")
    bad_links = [c["link"] for c in checks if c["verdict"] != "ok"]
    if bad_links:
        print(f"\nWARNING: links off their configuration: {', '.join(bad_links)} (see the table above)")
    info["load_average_at_end"] = list(os.getloadavg())
    info["total_wall_seconds"] = time.monotonic() - t0
    result = {
        "command": " ".join(["python", "benchmarks/replica_sync_slow.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": info,
        "settings": {"task": args.task, "split_points": SLOW_TASKS[args.task]["split_points"], "stages": STAGES, "replicas": REPLICAS,
                     "rank_layout": "global rank = replica * 2 + (1 - stage)",
                     "layouts": {x: {"sites_per_rank": LAYOUTS[x], "text": LAYOUT_TEXT[x]} for x in args.layouts},
                     "links": [link_label(x) for x in args.links], "relay_queue": args.latency,
                     "relay_rate": "per sending rank, no burst; within a site: no limit, no delay",
                     "configs": args.settings, "inner_steps": args.inner_steps, "steps": args.steps,
                     "budget": args.budget, "long_steps": args.long_steps, "val_every": args.val_every,
                     "eval_samples": args.eval_samples, "timing_steps": args.timing_steps, "skip": args.skip,
                     "baseline_steps": args.baseline_steps, "baseline_skip": args.baseline_skip,
                     "data_limit": args.data_limit, "seed": args.seed, "threads_per_rank": args.threads,
                     "tiny": args.tiny, "estimate_s": {"trajectories": traj_s, "timing": timing_s}},
        "target_val_loss": target, "link_checks": checks, "rows": rows,
        "trajectory_runs": traj_rows, "timing_runs": timing_rows, "disturbed_runs": busy,
    }
    paths = write_results(result, args.out, args.stem)
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({(time.monotonic() - t0) / 60:.1f} min)")
    failed = [r for r in traj_rows + timing_rows if r["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
