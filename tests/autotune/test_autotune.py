"""Autotune: the choice of codecs per boundary (pure), and the link probes it rests on (real gloo ranks).

The probe tests run two gloo ranks on loopback, and, as root with TUN devices, two ranks in network namespaces
joined by the project's user-space delay link (benchmarks/_delay_link.py) at 25 Mbit/s and 25 ms each way.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_clapping.autotune.choose import (
    DEFAULT_CANDIDATES,
    Choice,
    boundary_ladders,
    choose,
    choose_pipeline,
    describe,
    fresh_steps,
    ladder,
    log_values,
)
from lightning_clapping.autotune.frontier import admissible, load_table
from lightning_clapping.autotune.ladders import first_visit_fraction
from lightning_clapping.autotune.messages import UNCOMPRESSED, message_bytes
from lightning_clapping.autotune.probe import LinkMeasure, codec_times, probe_boundaries, probe_link, probe_plan
from lightning_clapping.autotune.tune import agree
from conftest import launch_forked, run_gloo_ranks
from lightning_clapping.comm.wire import message_nbytes
from lightning_clapping.codecs import get_codec
from lightning_clapping.codecs.feedback import MessageRule

ROOT = Path(__file__).resolve().parents[2]
MBIT = 1e6 / 8  # bytes per second of one Mbit/s

ACT = [((4, 128, 128), torch.float32)]  # one micro-batch's activation (and its gradient)
COMPUTE = 0.020  # forward + backward seconds per micro-batch


def link(mbit: float, delay_ms: float = 0.0, reverse_mbit: float | None = None) -> LinkMeasure:
    return LinkMeasure(delay_ms / 1e3, mbit * MBIT, None if reverse_mbit is None else reverse_mbit * MBIT)


def shapes(*boundaries: int, spec=ACT) -> dict:
    return {b: {"fwd": spec, "bwd": spec} for b in boundaries}


def settings(choices: dict[int, Choice]) -> dict[int, tuple[str, str, str]]:
    return {b: (c.variant, c.forward, c.backward) for b, c in choices.items()}


# ------------------------------------------------------------------------------------------------- choose (pure)


def test_message_bytes_are_the_codec_payloads_plus_the_header():
    shape = (4, 128, 128)
    for setting in ("bf16", "q8", "q4", "topk:0.1"):
        payload = get_codec(setting).payload_nbytes(shape, torch.float32)
        assert message_bytes(ACT, setting) == message_nbytes([(shape, payload)])
    assert message_bytes(ACT, UNCOMPRESSED) == message_nbytes([(shape, 4 * 4 * 128 * 128)])
    # a tensor that is not compressible (an int mask, or marked so) keeps its raw bytes under any codec
    mixed = [((8, 16), torch.float32), ((8, 16), torch.int64), ((8, 16), torch.float32, False)]
    q4 = get_codec("q4").payload_nbytes((8, 16), torch.float32)
    assert message_bytes(mixed, "q4") == message_nbytes([((8, 16), q4), ((8, 16), 8 * 128), ((8, 16), 4 * 128)])
    # a bool mask crosses as one bit per value, compressed or not
    masked = [((8, 16), torch.float32), ((8, 1, 16, 16), torch.bool)]
    for setting, payload in ((UNCOMPRESSED, 4 * 128), ("q4", q4)):
        assert message_bytes(masked, setting) == message_nbytes([((8, 16), payload), ((8, 1, 16, 16), 256)])


def test_a_fast_link_stays_uncompressed():
    choices = choose({0: link(10_000, 0.05)}, COMPUTE, shapes(0), variant="clapping-fc")
    assert settings(choices) == {0: (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED)}
    assert choices[0].forward_hides and choices[0].backward_hides
    assert choices[0].rule("fwd") == ("uncompressed", "identity")


def test_a_25_mbit_link_is_compressed_and_the_prediction_is_bytes_over_bandwidth():
    choices = choose({0: link(25, 25)}, COMPUTE, shapes(0), variant="clapping-fc")
    c = choices[0]
    # 262 kB take 84 ms at 25 Mbit/s: only q4 (33 kB, 10.7 ms) fits in 0.8 x 20 ms forward; backward stops at q8
    assert (c.variant, c.forward, c.backward) == ("clapping-fc", "q4", "q8")
    assert c.forward_hides and not c.backward_hides
    assert c.forward_s == pytest.approx(message_bytes(ACT, "q4") / (25 * MBIT))
    assert c.budget_s == pytest.approx(0.8 * COMPUTE)
    assert c.rule("fwd") == ("clapping-fc", "q4") and c.rule("bwd") == ("clapping-fc", "q8")
    assert c.forward_s < c.budget_s < min(s for d, setting, _, s in c.options if d == "fwd" and setting == "q8")


def test_the_least_lossy_setting_that_hides_is_taken_not_the_smallest():
    # 100 Mbit/s: uncompressed takes 21 ms, bf16 10.5 ms: bf16 hides, so neither q8 nor q4
    choices = choose({0: link(100)}, COMPUTE, shapes(0), variant="direct")
    assert settings(choices) == {0: ("direct", "bf16", "bf16")}


def test_a_mixed_cluster_compresses_only_its_slow_boundary():
    measures = {0: link(10_000, 0.05), 1: link(25, 25), 2: link(10_000, 0.05)}
    choices = choose(measures, [COMPUTE] * 4, shapes(0, 1, 2), variant="clapping-fu", full_fraction=0.0)
    assert settings(choices) == {
        0: (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED),
        1: ("clapping-fu", "q4", "q8"),
        2: (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED),
    }
    table = describe(choices, measures)
    assert len(table.splitlines()) == 2 + 3 + 1  # title, header, one line per boundary, the "!" note
    assert "q4 10.67 ms (unc. 83.9)" in table and "25.00" in table
    values = log_values(choices, measures)
    assert values["autotune/b1_compressed"] == 1.0 and values["autotune/b0_compressed"] == 0.0
    assert values["autotune/b1_delay_ms"] == pytest.approx(25.0)


def test_each_direction_follows_its_own_bandwidth():
    # forward fast, backward 25 Mbit/s (a per-sender rate): only the gradients are compressed
    choices = choose({0: link(10_000, 1, reverse_mbit=25)}, COMPUTE, shapes(0), variant="direct")
    assert settings(choices) == {0: ("direct", UNCOMPRESSED, "q8")}
    assert choices[0].rule("fwd") == ("uncompressed", "identity") and choices[0].rule("bwd") == ("direct", "q8")
    assert MessageRule(*choices[0].rule("fwd"), 0, "fwd").kind == "raw"


def test_when_nothing_hides_the_fastest_setting_is_taken():
    choices = choose({0: link(1)}, COMPUTE, shapes(0), variant="direct")
    c = choices[0]
    assert (c.forward, c.backward) == ("q4", "q8")
    assert not c.forward_hides and not c.backward_hides
    # and with a ladder whose most lossy rung is not the smallest, the smallest still wins
    odd = {"fwd": (UNCOMPRESSED, "q4", "bf16"), "bwd": (UNCOMPRESSED, "q8", "bf16")}
    c = choose({0: link(1)}, COMPUTE, shapes(0), odd, variant="direct")[0]
    assert (c.forward, c.backward) == ("q4", "q8")


def test_the_delay_does_not_change_the_choice():
    for mbit in (10_000, 100, 25, 1):
        near = choose({0: link(mbit, 0.0)}, COMPUTE, shapes(0), variant="direct")
        far = choose({0: link(mbit, 200.0)}, COMPUTE, shapes(0), variant="direct")
        assert settings(near) == settings(far), mbit


def test_ties_go_to_the_less_lossy_setting_and_repeat_exactly():
    # bf16 and fp16 send the same bytes: whichever comes first in the ladder wins, hidden or not
    for ladder_order, expected in (((UNCOMPRESSED, "fp16", "bf16"), "fp16"), ((UNCOMPRESSED, "bf16", "fp16"), "bf16")):
        cands = {"fwd": ladder_order, "bwd": ladder_order}
        for mbit in (1, 100):  # nothing hides / the 16-bit casts hide
            c = choose({0: link(mbit)}, COMPUTE, shapes(0), cands, variant="direct")[0]
            assert (c.forward, c.backward) == (expected, expected), (ladder_order, mbit)
    # a link exactly at the budget hides (<=)
    exact = message_bytes(ACT, UNCOMPRESSED) / (0.8 * COMPUTE)
    c = choose({0: LinkMeasure(0.0, exact)}, COMPUTE, shapes(0), variant="direct")[0]
    assert c.forward == UNCOMPRESSED and c.forward_hides
    # same inputs, same answer, and the answer survives its wire form
    measures = {0: link(25, 25), 1: link(300, 3)}
    first = choose(measures, [0.01, COMPUTE, 0.005], shapes(0, 1), variant="ef21")
    again = choose(dict(reversed(measures.items())), [0.01, COMPUTE, 0.005], shapes(1, 0), variant="ef21")
    assert first == again
    assert {b: Choice.from_wire(c.to_wire()) for b, c in first.items()} == first
    json.dumps([c.to_wire() for c in first.values()])  # plain values


def test_the_slowest_stage_sets_the_budget():
    # 100 Mbit/s: uncompressed (21 ms) hides behind a 30 ms cycle but not behind 20 ms
    assert choose({0: link(100)}, [0.001, 0.030], shapes(0), variant="direct")[0].forward == UNCOMPRESSED
    assert choose({0: link(100)}, {0: 0.001, 1: 0.020}, shapes(0), variant="direct")[0].forward == "bf16"
    assert choose({0: link(100)}, 0.020, shapes(0), variant="direct", headroom=1.1)[0].forward == UNCOMPRESSED


def test_full_precision_messages_of_a_variant_count_against_it():
    # 100 Mbit/s, budget 16 ms: uncompressed 21.0 ms, bf16 10.5, q8 5.3, q4 2.7. clapping-fu sends a share p of its
    # messages in full: p = 0.6 makes bf16 16.8 ms (q8 14.7), p = 0.7 makes q8 16.3 ms (q4 15.5)
    fu = {"variant": "clapping-fu"}
    assert choose({0: link(100)}, COMPUTE, shapes(0), full_fraction=0.0, **fu)[0].forward == "bf16"
    assert choose({0: link(100)}, COMPUTE, shapes(0), full_fraction=0.6, **fu)[0].forward == "q8"
    assert choose({0: link(100)}, COMPUTE, shapes(0), full_fraction=0.7, **fu)[0].forward == "q4"
    both = choose({0: link(100)}, COMPUTE, shapes(0), full_fraction=0.7, fresh={"fwd": UNCOMPRESSED, "bwd": None},
                  **fu)[0]
    assert (both.forward, both.backward) == ("q4", "bf16")


def test_the_ladder_ends_at_the_users_codec():
    assert ladder("fwd") == DEFAULT_CANDIDATES["fwd"] == (UNCOMPRESSED, "bf16", "q8", "q4")
    assert ladder("bwd") == (UNCOMPRESSED, "bf16", "q8")
    assert ladder("fwd", "q4") == (UNCOMPRESSED, "bf16", "q8", "q4")
    assert ladder("fwd", "q8") == (UNCOMPRESSED, "bf16", "q8")
    assert ladder("bwd", "q4") == (UNCOMPRESSED, "bf16", "q8", "q4")
    assert ladder("fwd", "topk:0.1") == (UNCOMPRESSED, "bf16", "q8", "q4", "topk:0.1")
    assert ladder("fwd", get_codec("q2")) == (UNCOMPRESSED, "bf16", "q8", "q4", "q2")
    assert ladder("fwd", "identity") == (UNCOMPRESSED,)
    # with the user's q8 forward, a 25 Mbit/s link gets q8, not q4
    c = choose({0: link(25)}, COMPUTE, shapes(0), {"fwd": ladder("fwd", "q8"), "bwd": ladder("bwd", "q8")},
               variant="direct")[0]
    assert (c.forward, c.backward) == ("q8", "q8")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="compressed variant"):
        choose({0: link(25)}, COMPUTE, shapes(0), variant="uncompressed")
    with pytest.raises(ValueError, match="unknown codec"):
        choose({0: link(25)}, COMPUTE, shapes(0), {"fwd": (UNCOMPRESSED, "q9x"), "bwd": (UNCOMPRESSED,)})
    with pytest.raises(ValueError, match="no link measurement"):
        choose({}, COMPUTE, shapes(0))
    with pytest.raises(ValueError, match="compute"):
        choose({0: link(25)}, [math.nan], shapes(0))
    with pytest.raises(ValueError, match="full_fraction"):
        choose({0: link(25)}, COMPUTE, shapes(0), full_fraction=1.5)


# ------------------------------------------------------------------------------------------------- step rule
STEP = {"schedule": "1f1b", "num_microbatches": 8}
CYCLE = 0.030  # forward + backward per micro-batch of the 4-stage benchmark model (loopback step 0.33 s / 11)
CODEC = {b: {d: {"bf16": (0.0005, 0.0003), "q8": (0.0015, 0.0006), "q4": (0.0015, 0.0006)} for d in ("fwd", "bwd")}
         for b in range(3)}  # sender, receiver seconds per message: a few per cent of compute, as on this CPU
USER = {d: ladder(d, c) for d, c in (("fwd", "q4"), ("bwd", "q8"))}


def pipeline(mbit: float, delay_ms: float, **kwargs) -> dict[int, Choice]:
    measures = {b: link(mbit, delay_ms) for b in range(3)}
    return choose(measures, [CYCLE] * 4, shapes(0, 1, 2), variant="clapping-fc",
                  **{**STEP, "candidates": USER, "codec_s": CODEC, **kwargs})


def test_on_a_delayed_100_mbit_link_the_step_rule_compresses_what_the_per_message_rule_left_uncompressed():
    # 262 kB in 21 ms hides behind a 30 ms cycle, but under 1F1B with 25 ms of delay every transfer lengthens the
    # round trips the step waits for (auto chose bf16 here with the per-message rule and was 12 % slower than q4/q8)
    per_message = choose({b: link(100, 25) for b in range(3)}, [CYCLE] * 4, shapes(0, 1, 2), USER,
                         variant="clapping-fc")
    assert {c.forward for c in per_message.values()} == {UNCOMPRESSED}
    by_step = pipeline(100, 25)
    assert all(c.variant == "clapping-fc" for c in by_step.values())
    unc = {"fwd": (UNCOMPRESSED,), "bwd": (UNCOMPRESSED,)}
    assert pipeline(100, 25, candidates=unc)[0].step_s > 1.1 * by_step[0].step_s  # what the old choice cost
    fastest = pipeline(100, 25, tolerance=0.0)  # the fastest the model finds: q4/q8 everywhere
    assert {(c.forward, c.backward) for c in fastest.values()} == {("q4", "q8")}
    assert by_step[0].step_s <= 1.05 * fastest[0].step_s + 1e-12
    rung = {d: {setting: i for i, setting in enumerate(USER[d])} for d in USER}
    lossiness = [sum(rung["fwd"][c.forward] + rung["bwd"][c.backward] for c in x.values()) for x in (by_step, fastest)]
    assert lossiness[0] < lossiness[1]  # the 5 % bought less lossy settings
    assert pipeline(100, 25) == by_step and by_step[0].schedule == "1f1b"


def test_the_step_rule_keeps_a_fast_link_uncompressed_because_the_codec_work_costs_more_than_it_saves():
    # at 3 Gbit/s an uncompressed message takes 0.7 ms: q4 would save 0.6 ms of transfer and cost 2 ms of codec work
    choices = pipeline(3000, 0.05, tolerance=0.0)
    assert {(c.forward, c.backward) for c in choices.values()} == {(UNCOMPRESSED, UNCOMPRESSED)}
    free_codecs = pipeline(3000, 0.05, tolerance=0.0, codec_s={})
    assert {(c.forward, c.backward) for c in free_codecs.values()} == {("q4", "q8")}
    assert "predicted step" in describe(choices, {b: link(3000, 0.05) for b in range(3)})


def test_the_step_rule_compresses_a_slow_link_fully_and_only_the_slow_boundary_of_a_mixed_cluster():
    assert {(c.forward, c.backward) for c in pipeline(10, 25).values()} == {("q4", "q8")}
    measures = {0: link(10_000, 0.05), 1: link(25, 25), 2: link(10_000, 0.05)}
    mixed = choose(measures, [CYCLE] * 4, shapes(0, 1, 2), USER, variant="clapping-fc", codec_s=CODEC,
                   schedule="gpipe", num_microbatches=8)
    assert settings(mixed) == {0: (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED), 1: ("clapping-fc", "q4", "q8"),
                               2: (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED)}
    assert log_values(mixed, measures)["autotune/predicted_step_ms"] == pytest.approx(mixed[0].step_s * 1e3)


def test_autotune_switches_to_gpipe_only_when_its_predicted_step_is_clearly_shorter():
    args = ({b: link(100, 25) for b in range(3)}, [CYCLE] * 4, shapes(0, 1, 2), USER)
    kw = {"variant": "clapping-fc", "codec_s": CODEC, "num_microbatches": 8}
    delayed = choose_pipeline(*args, schedules=("1f1b", "gpipe"), **kw)
    assert delayed[0].schedule == "gpipe"
    assert delayed[0].step_s < 0.8 * choose(*args, schedule="1f1b", **kw)[0].step_s
    near = ({b: link(10_000, 0.05) for b in range(3)}, *args[1:])
    assert choose_pipeline(*near, schedules=("1f1b", "gpipe"), **kw)[0].schedule == "1f1b"  # equal: keep the first
    assert choose_pipeline(*near, schedules=("gpipe", "1f1b"), **kw)[0].schedule == "gpipe"


def test_the_step_rule_needs_the_number_of_micro_batches_and_every_boundary():
    with pytest.raises(ValueError, match="num_microbatches"):
        choose({0: link(25)}, COMPUTE, shapes(0), schedule="gpipe")
    with pytest.raises(ValueError, match="every boundary of 3 stages"):
        choose({0: link(25), 2: link(25)}, [COMPUTE] * 3, {0: shapes(0)[0], 2: shapes(0)[0]}, schedule="gpipe",
               num_microbatches=2)


def test_codec_times_are_measured_on_the_message_and_the_sender_does_more_work():
    times = codec_times(ACT, (UNCOMPRESSED, "bf16", "q4"), repeats=2)
    assert times[UNCOMPRESSED] == (0.0, 0.0)
    for setting in ("bf16", "q4"):
        sender, receiver = times[setting]
        assert 0 < receiver < sender < 1.0, (setting, times[setting])
    assert codec_times([((8,), torch.int64)], ("q4",)) == {"q4": (0.0, 0.0)}  # nothing to compress


# ------------------------------------------------------------------------- the user's map, fresh steps, the frontier
TWO = {"schedule": "1f1b", "num_microbatches": 1}  # 2 stages, 1 micro-batch: a step is easy to play by hand


def test_a_boundary_mapped_to_none_keeps_a_single_uncompressed_rung_and_the_others_end_at_the_users_codec():
    ladders = boundary_ladders(3, {"fwd": {1: "q8", 2: get_codec("q4")}, "bwd": {1: "q8", 2: None}})
    assert ladders[0] == {"fwd": (UNCOMPRESSED,), "bwd": (UNCOMPRESSED,)}  # left out of both maps
    assert ladders[1] == {"fwd": (UNCOMPRESSED, "bf16", "q8"), "bwd": (UNCOMPRESSED, "bf16", "q8")}
    assert ladders[2] == {"fwd": (UNCOMPRESSED, "bf16", "q8", "q4"), "bwd": (UNCOMPRESSED,)}
    assert boundary_ladders(2, {"fwd": "q8", "bwd": None})[1] == {"fwd": ladder("fwd", "q8"), "bwd": ladder("bwd")}
    # links too slow for anything but the most lossy rung: each direction takes the last rung of its own ladder
    slow = {b: link(1, 25) for b in range(3)}
    c = choose(slow, [CYCLE] * 4, shapes(0, 1, 2), ladders, variant="clapping-fc")
    assert settings(c) == {0: (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED), 1: ("clapping-fc", "q8", "q8"),
                           2: ("clapping-fc", "q4", UNCOMPRESSED)}
    c = choose(slow, [CYCLE] * 4, shapes(0, 1, 2), ladders, variant="clapping-fc", **STEP)  # the step rule
    assert all(c[b].setting(d) in ladders[b][d] for b in range(3) for d in ("fwd", "bwd"))
    assert settings(c)[0] == (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED) and c[1].compressed


def test_fresh_steps_and_the_fresh_codec_are_priced_as_a_hand_computation_gives():
    # 2 stages, 1 micro-batch, 1F1B, no codec work: a step is F0, forward transfer, F1, B1, backward transfer, B0,
    # that is 2 x compute + 2 x delay + both transfers. clapping-fu with p = 0.4 and fresh_codec q8 sends q8 both ways
    # on 40 % of the steps and q4 / bf16 on the others: the step the model predicts is the mean of the two steps
    bw, delay, p = 25 * MBIT, 0.010, 0.4
    ladders = {"fwd": ("q4",), "bwd": ("bf16",)}
    f, fresh = fresh_steps("clapping-fu", "q8", p)
    assert (f, fresh) == (p, {"fwd": "q8", "bwd": "q8"})
    c = choose({0: LinkMeasure(delay, bw)}, COMPUTE, shapes(0), ladders, variant="clapping-fu", full_fraction=f,
               fresh=fresh, **TWO)[0]
    q4, q8, bf16 = (message_bytes(ACT, s) for s in ("q4", "q8", "bf16"))
    usual = 2 * COMPUTE + 2 * delay + (q4 + bf16) / bw
    fresh_step = 2 * COMPUTE + 2 * delay + (q8 + q8) / bw
    assert c.step_s == pytest.approx((1 - p) * usual + p * fresh_step, rel=1e-12)
    assert c.forward_s == pytest.approx(((1 - p) * q4 + p * q8) / bw, rel=1e-12)
    assert c.backward_s == pytest.approx(((1 - p) * bf16 + p * q8) / bw, rel=1e-12)
    assert (c.forward_fresh, c.backward_fresh, c.full_fraction) == ("q8", "q8", p)
    # without a fresh codec clapping-fu sends its fresh steps in full precision
    f, fresh = fresh_steps("clapping-fu", None, p)
    c = choose({0: LinkMeasure(delay, bw)}, COMPUTE, shapes(0), ladders, variant="clapping-fu", full_fraction=f,
               fresh=fresh, **TWO)[0]
    full = message_bytes(ACT, UNCOMPRESSED)
    assert c.step_s == pytest.approx((1 - p) * usual + p * (2 * COMPUTE + 2 * delay + 2 * full / bw), rel=1e-12)
    assert c.fresh_codec("fwd") is None  # MessageRule(fresh_codec=None): full precision
    # AQ-SGD: the first visits go in full forward only; clapping-fc without a fresh codec has no fresh form
    f, fresh = fresh_steps("aqsgd", None, 1.0, first_visits=0.25)
    c = choose({0: LinkMeasure(delay, bw)}, COMPUTE, shapes(0), ladders, variant="aqsgd", full_fraction=f,
               fresh=fresh, **TWO)[0]
    assert c.step_s == pytest.approx(0.75 * usual + 0.25 * (2 * COMPUTE + 2 * delay + (full + bf16) / bw), rel=1e-12)
    c = choose({0: LinkMeasure(delay, bw)}, COMPUTE, shapes(0), ladders, variant="clapping-fc",
               **dict(zip(("full_fraction", "fresh"), fresh_steps("clapping-fc", None, 0.5))), **TWO)[0]
    assert c.step_s == pytest.approx(usual, rel=1e-12)


def test_aqsgds_first_visits_are_the_first_epochs_fresh_steps_over_the_rest_of_the_run():
    assert first_visit_fraction(1.0, 2, 10, 40) == pytest.approx(8 / 38)  # 8 first-epoch steps of the 38 left
    assert first_visit_fraction(0.5, 2, 10, 40) == pytest.approx(0.5 * 8 / 38)  # lazy sampling: its fresh steps
    assert first_visit_fraction(1.0, 2, 100, 40) == 1.0  # the run ends inside its first epoch
    assert first_visit_fraction(1.0, 12, 10, 40) == 0.0  # past the first epoch
    assert first_visit_fraction(1.0, 2, 10, math.inf) == 0.0 and first_visit_fraction(0.5, 2, math.inf, 9) == 0.5


def test_a_relaxed_codec_lifts_a_more_lossy_fresh_codec_and_the_strategys_rule_sends_what_was_priced():
    from lightning_clapping import ClappingStrategy

    f, fresh = fresh_steps("clapping-fu", "q4", 0.5)  # fresh steps more lossy than the q8 the user gave
    ladders = {"fwd": ladder("fwd", "q8"), "bwd": ladder("bwd", "q8")}
    fast = choose({0: link(100)}, COMPUTE, shapes(0), ladders, variant="clapping-fu", full_fraction=f,
                  fresh=fresh)[0]
    slow = choose({0: link(1)}, COMPUTE, shapes(0), ladders, variant="clapping-fu", full_fraction=f, fresh=fresh)[0]
    assert (fast.forward, fast.forward_fresh, fast.fresh_codec("fwd")) == ("bf16", "bf16", "bf16")  # relaxed
    assert (slow.forward, slow.forward_fresh, slow.fresh_codec("fwd")) == ("q8", "q4", "q4")  # as the user gave
    assert fast.forward_s == pytest.approx(message_bytes(ACT, "bf16") / (100 * MBIT))
    strategy = ClappingStrategy(variant="clapping-fu", forward_codec="q8", backward_codec="q8", fresh_codec="q4",
                                autotune=True)
    strategy._tuning.choices = {0: fast}
    rule = strategy._tuning.make_rule(0, "fwd", training=True)
    assert (rule.variant, rule.codec.name, rule.fresh_codec.name) == ("clapping-fu", "bf16", "bf16")
    strategy._tuning.choices = {0: Choice.from_wire(fast.to_wire()[:15])}  # saved before fresh forms: as configured
    assert strategy._tuning.make_rule(0, "fwd", training=True).fresh_codec.name == "q4"


def _frontier_table(deficits: dict[str, tuple[float, float]]) -> dict:
    """A table like frontier.json: clapping-fc p=0.5 settings with these (Fashion-MNIST points, Shakespeare %)."""
    codecs = {"fine": ("q8", "q8"), "coarse": ("q2", "q4"), "sparse": ("topk:0.1+q4", "topk:0.1+q4")}
    return {"format": 1, "tasks": {"fashion_mnist": {"unit": "points"}, "shakespeare": {"unit": "%"}},
            "settings": [{"config": name, "variant": "clapping-fc", "p": 0.5, "fwd": codecs[name][0],
                          "bwd": codecs[name][1], "fresh": None,
                          "deficit": {"fashion_mnist": pts, "shakespeare": pct}} for name, (pts, pct) in
                         deficits.items()]}


def test_the_frontier_rule_takes_a_published_setting_within_the_quality_tolerance_only_where_links_need_it():
    table = _frontier_table({"fine": (0.1, 0.2), "coarse": (0.9, 1.0), "sparse": (3.0, 0.5)})
    within = admissible("clapping-fc", 0.5, table=table)  # default tolerance: 1 point, 2 %
    assert [s.config for s in within] == ["fine", "coarse"]  # sparse loses 3 points
    assert admissible("clapping-fc", 0.25, table=table) == [] and admissible("ef21", 0.5, table=table) == []
    assert [s.config for s in admissible("clapping-fc", 0.5, {"points": 5.0}, table=table)] == [
        "fine", "coarse", "sparse"]
    user = {"fwd": ladder("fwd", "q8"), "bwd": ladder("bwd", "q8")}  # the user's q8 tops both ladders
    kw = {"variant": "clapping-fc", "codec_s": CODEC, **STEP}

    def run(measures, settings):
        return choose(measures, [CYCLE] * 4, shapes(0, 1, 2), user, frontier=settings, **kw)

    # 10 Mbit/s: q8 is all the ladders allow; the published coarse q2/q4 is faster, and within the tolerance
    slow = {b: link(10, 25) for b in range(3)}
    chosen = run(slow, within)
    assert {(c.forward, c.backward, c.frontier) for c in chosen.values()} == {("q2", "q4", "coarse")}
    assert chosen[0].step_s < run(slow, ())[0].step_s / 1.05
    # sparse would be faster still, but it is out of the tolerance; admitted, it is taken
    wider = admissible("clapping-fc", 0.5, {"points": 5.0}, table)
    assert {c.frontier for c in run(slow, wider).values()} == {"sparse"}
    # a fast link: the ladders' choice is kept
    fast = {b: link(10_000, 0.05) for b in range(3)}
    assert run(fast, within) == run(fast, ())
    # a mixed cluster: only the slow boundary takes the published setting
    mixed = run({0: link(10_000, 0.05), 1: link(10, 25), 2: link(10_000, 0.05)}, within)
    assert settings(mixed) == {0: (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED), 1: ("clapping-fc", "q2", "q4"),
                               2: (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED)}
    assert "frontier rule" in describe(mixed, {b: link(10, 25) for b in range(3)})
    # a boundary the user left uncompressed stays so under the frontier rule too, however slow its link
    mapped = choose({0: link(10, 25), 1: link(0.5, 25), 2: link(10, 25)}, [CYCLE] * 4, shapes(0, 1, 2),
                    boundary_ladders(3, {"fwd": {1: "q8"}, "bwd": {1: "q8"}}),
                    frontier=within, **kw)
    assert settings(mapped)[0] == settings(mapped)[2] == (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED)
    assert settings(mapped)[1] == ("clapping-fc", "q2", "q4")
    with pytest.raises(ValueError, match="frontier rule prices whole steps"):
        choose(slow, [CYCLE] * 4, shapes(0, 1, 2), user, frontier=within, variant="clapping-fc")


def test_the_packaged_frontier_table_is_the_one_the_committed_results_give():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import frontier_table

    results = json.loads((ROOT / "benchmarks" / "results" / "quality.json").read_text())
    assert load_table() == frontier_table.build(results, frontier_table.load_longer()), \
        "stale: run python benchmarks/frontier_table.py"
    assert {(s["variant"], s["fwd"], s["bwd"]) for s in load_table()["settings"]} >= {("direct", "q4", "q8")}


def test_the_frontier_table_leaves_model_changes_and_schedules_out():
    """autotune chooses fixed codecs: a Bottleneck run (a model change) or a codec schedule is neither a setting nor
    what beats one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import frontier_table

    def agg(label, ratio, deficit, model_change=False, scheduled=False):
        return {"task": "shakespeare", "label": label, "variant": "direct", "p": 1.0, "fwd": "q4", "bwd": label,
                "fresh": None, "bytes_ratio": ratio, "deficit_vs_uncompressed": deficit, "seeds": 3,
                "model_change": model_change, "scheduled": scheduled}

    results = {"mode": "standard", "mode_settings": {"tasks": {"shakespeare": {"steps": 120}}},
               "tasks": {"shakespeare": {"metric": "val_loss"}}, "frontier": {"shakespeare": {"unit": "%"}},
               "aggregates": [agg("q8", 5.0, 0.2), agg("q2", 10.0, 9.0), agg("bn8", 31.0, 0.4, model_change=True),
                              agg("q1 then q8", 12.0, 0.1, scheduled=True)]}
    table = frontier_table.build(results)
    assert [(s["config"], s["frontier"]) for s in table["settings"]] == [("q2", ["shakespeare"]),
                                                                         ("q8", ["shakespeare"])]


def test_a_setting_a_longer_run_measured_outside_the_tolerance_is_not_admissible():
    table = _frontier_table({"fine": (0.1, 0.2), "coarse": (0.9, 1.0)})
    assert [s.config for s in admissible("clapping-fc", 0.5, table=table)] == ["fine", "coarse"]
    table["longer_runs"] = {"tasks": {"shakespeare": {"unit": "%"}, "fashion_vit": {"unit": "points"}},
                            "settings": [{"config": "coarse", "deficit": {"shakespeare": 1.5, "fashion_vit": 1.2}},
                                         {"config": "fine", "deficit": {"shakespeare": 1.9, "fashion_vit": 0.9}}]}
    [fine] = admissible("clapping-fc", 0.5, table=table)
    assert fine.config == "fine" and fine.worst == pytest.approx(0.95)  # its worst: 1.9 % of 2 % on a longer run
    assert [s.config for s in admissible("clapping-fc", 0.5, {"points": 1.5}, table=table)] == ["fine", "coarse"]


def test_the_frontier_table_quotes_the_longer_runs_worst_task_and_cross_task_result():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import frontier_table

    def agg(task, label, ratio, deficit, model_change=False, steps=480):
        codec = None if label == "uncompressed" else "q8"
        return {"task": task, "label": label, "fwd": codec, "bwd": codec,
                "bytes_ratio": ratio, "deficit_vs_uncompressed": deficit, "seeds": 3, "steps": steps,
                "model_change": model_change}

    # on every task: two codec settings within tolerance (q8 saves less), and three model changes: bn4 and bn8 tie on
    # their worst task (2.8 points, equal but for float noise), bn4 is better on the next worst; bn16 worse
    long = {"aggregates": [agg("shakespeare", "uncompressed", 1.0, 0.0),
                           agg("shakespeare", "direct moderate", 5.3, 1.4), agg("shakespeare", "direct q8", 3.9, 0.1),
                           agg("shakespeare", "direct bn4 moderate", 21.0, 2.9, True),
                           agg("shakespeare", "direct bn8 q8", 31.5, 4.2, True),
                           agg("shakespeare", "direct bn16 q8", 60.0, 5.0, True)],
            "frontier": {"shakespeare": {"unit": "%"}}}
    more = {"aggregates": [agg("wordnet_glosses", "direct moderate", 5.3, 1.2),
                           agg("wordnet_glosses", "direct q8", 3.9, 0.1),
                           agg("wordnet_glosses", "direct bn4 moderate", 21.0, 0.4, True),
                           agg("wordnet_glosses", "direct bn8 q8", 31.4, 1.7, True),
                           agg("wordnet_glosses", "direct bn16 q8", 60.0, 2.0, True),
                           agg("fashion_vit", "direct moderate", 5.3, 0.7, steps=860),
                           agg("fashion_vit", "direct q8", 3.9, 0.1, steps=860),
                           agg("fashion_vit", "direct bn4 moderate", 21.2, 2.79999971, True, steps=860),
                           agg("fashion_vit", "direct bn8 q8", 31.7, 2.79999772, True, steps=860),
                           agg("fashion_vit", "direct bn16 q8", 60.0, 3.5, True, steps=860)],
            "frontier": {"wordnet_glosses": {"unit": "%"}, "fashion_vit": {"unit": "points"}}}
    section = frontier_table.longer_runs({"frontier_long/quality.json": long, "more_tasks/quality.json": more})
    assert {t: i["steps"] for t, i in section["tasks"].items()} == {"shakespeare": 480, "wordnet_glosses": 480,
                                                                     "fashion_vit": 860}
    rows = {r["config"]: r for r in section["settings"]}
    assert rows["direct bn4 moderate"]["worst_task"] == "fashion_vit" and not rows["direct bn4 moderate"][
        "within_tolerance"]
    assert "uncompressed" not in rows and rows["direct moderate"]["within_tolerance"]
    assert section["most_saved_within_tolerance_on_every_task"] == "direct moderate"
    assert section["best_model_change_by_its_worst_task"] == "direct bn4 moderate"


def test_autotune_options_say_what_is_wrong():
    from lightning_clapping import ClappingStrategy

    s = ClappingStrategy(variant="clapping-fu", autotune={"frontier": True, "accuracy_points": 0.5}).options
    assert s.autotune and s.autotune_settings.frontier and s.autotune_settings.quality == {"points": 0.5, "%": 2.0}
    assert ClappingStrategy(variant="direct", autotune="frontier").options.autotune_settings.frontier
    assert not ClappingStrategy(variant="direct", autotune=True).options.autotune_settings.frontier
    for bad, message in (("fast", "autotune is True, False, 'frontier'"), ({"accuracy_points": 1.0}, "frontier"),
                         ({"frontier": True, "loss_percent": -1}, "loss_percent"),
                         ({"frontier": True, "step_tolerance": "5%"}, "step_tolerance")):
        with pytest.raises(ValueError, match=message):
            ClappingStrategy(variant="direct", autotune=bad)


def test_lightning_cli_takes_schedule_auto_and_the_autotune_options(tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    from _models import SequentialMLP

    config = tmp_path / "config.yaml"
    config.write_text("""trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy:
    class_path: lightning_clapping.ClappingStrategy
    init_args:
      split_points: [net.4]
      variant: clapping-fc
      schedule: auto
      autotune:
        frontier: true
        loss_percent: 1.5
""")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    cli = LightningCLI(SequentialMLP, run=False, args=["--config", str(config)])
    options = cli.trainer.strategy.options
    assert (options.schedule, options.schedule_auto, options.autotune) == ("1f1b", True, True)
    assert options.autotune_settings.frontier and options.autotune_settings.quality["%"] == 1.5
    cli = LightningCLI(SequentialMLP, run=False, args=[
        "--config", str(config), "--trainer.strategy.init_args.autotune", "true"])
    assert cli.trainer.strategy.options.autotune and not cli.trainer.strategy.options.autotune_settings.frontier


# ------------------------------------------------------------------------- the same promises through a real run
#: what the probes report in the runs below (the pipeline itself runs on loopback): slow, and slower at boundary 1
SLOW = {0: LinkMeasure(0.010, 1 * MBIT), 1: LinkMeasure(0.010, 0.2 * MBIT)}
MLP_ACT = [((16, 32), torch.float32)]  # SequentialMLP's activation of one micro-batch: batch 32, 2 micro-batches


def _fit_on_slow_links(out: str) -> None:
    """Forked ranks: 3-stage clapping-fu fits of 4 steps (lazy sampling at p = 0.5), the codecs given for boundary 1
    only, with the link probes reporting :data:`SLOW`; once with the ladders, once with the frontier rule (every
    published setting admitted). Writes what autotune chose and the rules built from it."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from _models import SequentialMLP, classification_data
    from lightning_clapping import ClappingStrategy, LazySamplingDataModule
    from lightning_clapping.autotune import tune

    tune.probe_boundaries = lambda stage, num_stages, *args, **kwargs: {
        b: SLOW[b] for b, _, _ in probe_plan(stage, num_stages)}
    for run, autotune in (("ladders", True), ("frontier", {"frontier": True, "accuracy_points": 100.0,
                                                            "loss_percent": 100.0})):
        torch.manual_seed(0)
        x, y = classification_data(n=128, seed=1)
        strategy = ClappingStrategy(split_points=["net.2", "net.4"], microbatches=2, variant="clapping-fu",
                                    forward_codec={1: "q8"}, backward_codec={1: "q8"}, autotune=autotune)
        trainer = L.Trainer(accelerator="cpu", devices=3, max_steps=4, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                            strategy=strategy)
        trainer.fit(SequentialMLP(), datamodule=LazySamplingDataModule(DataLoader(TensorDataset(x, y), batch_size=32)))
        rules = {f"{b}{d}": [r.variant, r.codec.name, r.fresh_codec and r.fresh_codec.name]
                 for b in (0, 1) for d in ("fwd", "bwd") for r in [strategy._tuning.make_rule(b, d, training=True)]}
        choices = {b: c.to_wire() for b, c in strategy.autotuned.items()}
        Path(out, f"{run}_rank{trainer.global_rank}.json").write_text(json.dumps({"choices": choices, "rules": rules}))


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("autotune_slow")
    launch_forked(_fit_on_slow_links, str(out), ranks=3, cwd=out, timeout=300)
    runs = {}
    for run in ("ladders", "frontier"):
        ranks = [json.loads((out / f"{run}_rank{r}.json").read_text()) for r in range(3)]
        assert all(r == ranks[0] for r in ranks)  # every rank follows the same choice
        runs[run] = ({int(b): Choice.from_wire(w) for b, w in ranks[0]["choices"].items()}, ranks[0]["rules"])
    return runs


def test_a_real_run_keeps_a_boundary_mapped_to_none_uncompressed_and_never_goes_beyond_the_users_codec(slow_runs):
    for run in ("ladders", "frontier"):
        choices, rules = slow_runs[run]
        assert (choices[0].variant, choices[0].forward, choices[0].backward) == ("uncompressed",) * 3, run
        assert rules["0fwd"][0] == rules["0bwd"][0] == "uncompressed"
    choices, rules = slow_runs["ladders"]
    c = choices[1]
    assert c.forward in ladder("fwd", "q8") and c.backward in ladder("bwd", "q8") and c.compressed
    assert rules["1fwd"][:2] == list(c.rule("fwd")) and rules["1bwd"][:2] == list(c.rule("bwd"))


def test_a_real_run_prices_clapping_fus_full_precision_fresh_steps_at_the_samplers_p(slow_runs):
    c = slow_runs["ladders"][0][1]
    assert message_bytes(MLP_ACT, c.forward) == c.forward_bytes  # the message autotune priced
    assert (c.full_fraction, c.forward_fresh, c.backward_fresh) == (0.5, UNCOMPRESSED, UNCOMPRESSED)
    full = message_bytes(MLP_ACT, UNCOMPRESSED)
    assert c.forward_s == pytest.approx((0.5 * c.forward_bytes + 0.5 * full) / SLOW[1].bandwidth("fwd"), rel=1e-9)
    assert slow_runs["ladders"][1]["1fwd"][2] is None  # fresh steps in full precision, as priced


def test_a_real_run_with_the_frontier_rule_takes_a_published_setting_on_slow_links(slow_runs):
    choices, rules = slow_runs["frontier"]
    c = choices[1]
    published = {s["config"]: s for s in load_table()["settings"]}
    assert c.frontier in published, c
    setting = published[c.frontier]
    assert (setting["variant"], setting["p"]) == ("clapping-fu", 0.5)
    published_directions = 0
    for d in ("fwd", "bwd"):  # the published codecs (and fresh codec), or the ladders' where the link allows
        if c.setting(d) == setting[d]:
            published_directions += 1
            assert rules[f"1{d}"] == ["clapping-fu", setting[d], setting["fresh"]]
        else:
            assert c.setting(d) in ladder(d, "q8") and rules[f"1{d}"] == ["clapping-fu", c.setting(d), None]
    assert published_directions >= 1
    assert c.step_s < slow_runs["ladders"][0][1].step_s / 1.05


# ------------------------------------------------------------------------------------------------- probe plan


def test_the_probe_plan_pairs_every_boundary_once_per_phase():
    for n in range(1, 9):
        plans = {s: probe_plan(s, n) for s in range(n)}
        for b in range(n - 1):  # both ends list the boundary, the lower stage initiates
            assert [p for p in plans[b] if p[0] == b] == [(b, b + 1, True)]
            assert [p for p in plans[b + 1] if p[0] == b] == [(b, b, False)]
        for s, plan in plans.items():
            # even boundaries first, at most one per phase: no stage waits for a neighbour busy with another probe
            assert [b % 2 for b, _, _ in plan] == sorted({b % 2 for b, _, _ in plan}), (n, s, plan)
            assert len(plan) == (n > 1) * (1 + (0 < s < n - 1))


# ------------------------------------------------------------------------------------------------- real probes


def _worker(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        m = probe_link(1 - rank, rank == 0, nbytes=1 << 20, pings=5, timeout=timedelta(seconds=30))
        out.put(("link", rank, m.to_wire()))
        m = probe_link(1 - rank, rank == 1, nbytes=1, pings=2, min_repeats=1, max_repeats=1, both_directions=False,
                       min_transfer_s=10.0)  # every transfer is "too short": the bulk grows to the largest
        out.put(("one way", rank, m.to_wire()))
        stage = 1 - rank  # as the strategy places stages: the last one on rank 0
        measures = probe_boundaries(stage, 2, lambda s: 1 - s, {0: 300_000}, timeout=timedelta(seconds=30))
        out.put(("boundaries", rank, {b: x.to_wire() for b, x in measures.items()}))
        mine = {0: {"fwd": ACT}} if stage == 0 else {0: {"bwd": ACT}}
        choices, every = agree(stage, 2, measures, COMPUTE * (2 - stage), mine, variant="clapping-fc")
        out.put(("agree", rank, ([c.to_wire() for c in choices.values()], {b: x.to_wire() for b, x in every.items()})))
        try:  # rank 0 refuses the arguments: every rank must hear it, none may wait for a broadcast that never comes
            agree(stage, 2, measures, COMPUTE, mine, variant="uncompressed")
            out.put(("refused", rank, None))
        except ValueError as err:
            out.put(("refused", rank, str(err)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def loopback():
    """What two gloo ranks on loopback reported: {(kind, rank): value}, plus their exit codes."""
    items, exitcodes = run_gloo_ranks(_worker, expected=10)
    results: dict = {(kind, rank): value for kind, rank, value in items}
    results["exitcodes"] = exitcodes
    return results


def test_a_loopback_link_has_a_small_delay_a_large_bandwidth_and_both_ends_agree(loopback):
    assert loopback["exitcodes"] == [0, 0]
    a, b = loopback[("link", 0)], loopback[("link", 1)]
    assert a == b  # bit for bit: the peer got the initiator's numbers
    m = LinkMeasure.from_wire(a)
    assert 0 < m.one_way_delay_s < 0.005, m
    assert m.rtt_s == pytest.approx(2 * m.one_way_delay_s)
    assert m.bandwidth("fwd") > 100e6 and m.bandwidth("bwd") > 100e6, m
    # 1 MiB crosses loopback in well under a millisecond: the probe grows it (4-fold) to time it, unless busy CPUs
    # made even 1 MiB take longer than a millisecond
    assert m.probe_bytes in (1 << 20, 4 << 20)


def test_a_probe_of_one_direction_started_by_the_other_rank(loopback):
    a, b = loopback[("one way", 0)], loopback[("one way", 1)]
    assert [float.hex(x) for x in a] == [float.hex(x) for x in b]  # exact, NaN (no reverse rate) included
    m = LinkMeasure.from_wire(a)
    assert m.reverse_bandwidth_bytes_per_s is None and m.bandwidth("bwd") == m.bandwidth("fwd") > 100e6
    assert m.probe_bytes == 4 << 20  # 1 byte asked, raised to 256 KiB, grown to 1 MiB and 4 MiB (the largest)


def test_probing_the_boundaries_gives_both_stages_the_same_measure_of_their_boundary(loopback):
    a, b = loopback[("boundaries", 0)], loopback[("boundaries", 1)]
    assert a == b and set(a) == {0}
    m = LinkMeasure.from_wire(a[0])
    assert m.probe_bytes >= 300_000 and m.one_way_delay_s < 0.005 and m.bandwidth("fwd") > 100e6


def test_every_rank_gets_the_same_choice_and_loopback_stays_uncompressed(loopback):
    (choices0, every0), (choices1, every1) = loopback[("agree", 0)], loopback[("agree", 1)]
    assert choices0 == choices1 and every0 == every1
    c = Choice.from_wire(choices0[0])
    assert (c.variant, c.forward, c.backward) == (UNCOMPRESSED, UNCOMPRESSED, UNCOMPRESSED)
    # the slower stage's compute: stage 0 (rank 1) reported 40 ms, the deciding rank 0 (stage 1) 20 ms
    assert c.compute_s == pytest.approx(2 * COMPUTE)
    assert c.forward_bytes == message_bytes(ACT, UNCOMPRESSED)


def test_arguments_refused_on_the_deciding_rank_raise_on_every_rank(loopback):
    for rank in (0, 1):
        message = loopback[("refused", rank)]
        assert "autotune could not choose on rank 0: ValueError: variant is the compressed" in message


# ------------------------------------------------------------------------------------ real probes, delayed link

RATE_MBIT, DELAY_MS = 25.0, 25.0


def _delay_lab_or_skip():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _netns import Lab, delay_unavailable_reason

    reason = delay_unavailable_reason()
    if reason:
        pytest.skip(f"delayed links need root, namespaces and TUN devices: {reason}")
    return Lab


def _run_ranks(lab, endpoints, tmp_path: Path, *extra: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR=endpoints[0].addr,
               MASTER_PORT=str(29_000 + os.getpid() % 1000))
    procs, outs = [], []
    try:
        for rank, ep in enumerate(endpoints):  # rank 0 first: it hosts the rendezvous
            outs.append(tmp_path / f"rank{rank}.json")
            procs.append(subprocess.Popen(
                lab.command(ep, [sys.executable, str(ROOT / "tests/scripts/autotune_probe.py"), str(rank),
                                 str(len(endpoints)), str(outs[-1]), *extra]),
                env=dict(env, GLOO_SOCKET_IFNAME=ep.ifname), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True))
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert [p.returncode for p in procs] == [0] * len(procs), logs
    return [json.loads(o.read_text()) for o in outs]


def test_a_delayed_25_mbit_link_is_measured_and_compressed(tmp_path):
    Lab = _delay_lab_or_skip()
    tag = f"cat{os.getpid() % 100000}"
    with Lab(tag=tag) as lab:
        eps = lab.build_delay_star(2)
        lab.set_delay_links(RATE_MBIT, DELAY_MS)
        t0 = time.monotonic()
        ranks = _run_ranks(lab, eps, tmp_path)  # probes with the 262 kB message of a 4 x 128 x 128 activation
        seconds = time.monotonic() - t0
    assert ranks[0]["measures"] == ranks[1]["measures"]
    m = LinkMeasure.from_wire(ranks[0]["measures"]["0"])
    assert m.probe_bytes == message_bytes(ACT, UNCOMPRESSED)  # 87 ms to serialise, more than the round trip: kept
    print(f"\n25 Mbit/s, 25 ms: measured one-way {m.one_way_delay_s * 1e3:.2f} ms, "
          f"{m.bandwidth('fwd') * 8 / 1e6:.1f} / {m.bandwidth('bwd') * 8 / 1e6:.1f} Mbit/s, probe {m.probe_s:.2f} s "
          f"({seconds:.1f} s with start-up)\n{ranks[0]['table']}")
    assert abs(m.one_way_delay_s * 1e3 - DELAY_MS) <= 5.0, m
    for d in ("fwd", "bwd"):
        assert 0.7 * RATE_MBIT * MBIT <= m.bandwidth(d) <= 1.3 * RATE_MBIT * MBIT, (d, m)
    assert ranks[0]["choices"] == ranks[1]["choices"]
    c = Choice.from_wire(ranks[0]["choices"]["0"])
    assert c.variant == "direct" and c.forward != UNCOMPRESSED and c.backward != UNCOMPRESSED
