"""Schedules are data: every send meets its receive and no stage waits forever."""

from __future__ import annotations

import pytest

from lightning_clapping.pipeline.schedule import (
    Action,
    Exchange,
    Message,
    forward_only,
    get_schedule,
    gpipe,
    messages,
    one_f_one_b,
    simulate,
    simulate_exchanges,
    with_exchanges,
)
from lightning_clapping.pipeline.timing import Link, step_time

PAIRS = [(s, m) for s in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


@pytest.mark.parametrize("build", [gpipe, one_f_one_b, forward_only])
@pytest.mark.parametrize(("stages", "micro"), PAIRS)
def test_schedule_completes_without_deadlock(build, stages, micro):
    simulate(build(stages, micro))


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("stages", "micro"), PAIRS)
def test_every_microbatch_runs_forward_then_backward_once_per_stage(build, stages, micro):
    for actions in build(stages, micro):
        assert sorted(a.microbatch for a in actions if a.kind == "F") == list(range(micro))
        assert sorted(a.microbatch for a in actions if a.kind == "B") == list(range(micro))
        for j in range(micro):
            assert actions.index(Action("F", j)) < actions.index(Action("B", j))


@pytest.mark.parametrize(("stages", "micro"), PAIRS)
def test_every_send_has_exactly_one_matching_receive(stages, micro):
    sends, recvs = messages(one_f_one_b(stages, micro))
    flat = lambda rows: sorted((m.direction, m.src, m.dst, m.microbatch) for row in rows for m in row)  # noqa: E731
    assert flat(sends) == flat(recvs)
    assert len(flat(sends)) == 2 * (stages - 1) * micro


def test_1f1b_bounds_microbatches_in_flight_by_the_pipeline_depth():
    stages, micro = 4, 16
    for s, actions in enumerate(one_f_one_b(stages, micro)):
        in_flight = peak = 0
        for a in actions:
            in_flight += 1 if a.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == stages - s
    gpipe_peak = max(i + 1 for i, a in enumerate(gpipe(stages, micro)[0]) if a.kind == "F")
    assert gpipe_peak == micro


def test_simulator_detects_a_deadlock():
    bad = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(RuntimeError, match="before F0|deadlock"):
        simulate(bad)
    crossed = [[Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
               [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]]
    simulate(crossed)  # buffered sends let stage 0 run F1 first
    waits_for_grad = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
                      [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(waits_for_grad)


def test_unknown_schedule_name_is_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        get_schedule("zigzag")


# ---------------------------------------------------------------------------------------------- grouped messages
def _all_messages(schedule):
    return [m for row in messages(schedule)[0] for m in row]


def _resize_patterns(schedule, count=12):
    """No resize, every message resized, and ``count`` random subsets (fixed seed)."""
    import random

    rng = random.Random(len(schedule) * 100 + len(schedule[0]))
    msgs = _all_messages(schedule)
    return [frozenset(), frozenset(msgs)] + [frozenset(m for m in msgs if rng.random() < 0.5) for _ in range(count)]


GROUP_PAIRS = [(s, m) for s in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 8)]


@pytest.mark.parametrize("build", [gpipe, one_f_one_b, forward_only])
@pytest.mark.parametrize(("stages", "micro"), GROUP_PAIRS)
def test_grouped_messages_cannot_deadlock_under_nccl_semantics_whatever_resizes(build, stages, micro):
    schedule = build(stages, micro)
    steps = with_exchanges(schedule)
    assert [[a for a in row if isinstance(a, Action)] for row in steps] == schedule  # only exchanges are added
    for resized in _resize_patterns(schedule):
        simulate_exchanges(steps, resized)


def _one_message_per_group(schedule):
    """Every receive and every send in a group of its own, in schedule order (what blocking calls amount to)."""
    n = len(schedule)
    out = []
    for s, actions in enumerate(schedule):
        row = []
        for a in actions:
            sends, recvs = messages([actions if t == s else [] for t in range(n)])
            incoming = [m for m in recvs[s] if m.microbatch == a.microbatch and (m.direction == "fwd") == (a.kind == "F")]
            outgoing = [m for m in sends[s] if m.microbatch == a.microbatch and (m.direction == "fwd") == (a.kind == "F")]
            row += [Exchange((), tuple(incoming))] if incoming else []
            row += [a] + ([Exchange(tuple(outgoing), ())] if outgoing else [])
        out.append(row)
    return out


def test_the_nccl_model_finds_the_deadlock_of_one_message_per_group():
    # 1F1B's stage 0 sends F1's output while stage 1 sends B0's gradient: both wait for a receive never posted
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_exchanges(_one_message_per_group(one_f_one_b(2, 2)))
    simulate_exchanges(_one_message_per_group(gpipe(2, 2)))  # GPipe's sends never cross


def test_fusing_a_send_with_a_receive_that_depends_on_it_deadlocks_when_the_message_is_resized():
    # GPipe: stage 0's last forward output and the first gradient back in one group (the unsplit rule)
    f1, b0 = Message("fwd", 0, 1, 1), Message("bwd", 1, 0, 0)
    fused = [[Action("F", 0), Exchange((Message("fwd", 0, 1, 0),), ()), Action("F", 1), Exchange((f1,), (b0,)),
              Action("B", 0), Exchange((), (Message("bwd", 1, 0, 1),)), Action("B", 1)],
             with_exchanges(gpipe(2, 2))[1]]
    simulate_exchanges(fused)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_exchanges(fused, frozenset({f1}))
    assert Exchange((f1,), ()) in with_exchanges(gpipe(2, 2))[0]  # what with_exchanges does instead


def test_1f1b_issues_every_send_of_a_middle_stage_with_a_receive_but_the_last():
    steps = with_exchanges(one_f_one_b(3, 6))[1]
    fused = [s for s in steps if isinstance(s, Exchange) and s.sends and s.recvs]
    assert len(fused) == 11 and steps[-1] == Exchange((Message("bwd", 1, 0, 5),), ())  # 12 sends: 6 fwd, 6 bwd


def test_the_nccl_model_refuses_orders_that_pair_different_messages():
    a, b = Message("fwd", 0, 1, 0), Message("fwd", 0, 1, 1)
    swapped = [[Action("F", 0), Exchange((a,), ()), Action("F", 1), Exchange((b,), ())],
               [Exchange((), (b,)), Action("F", 1), Exchange((), (a,)), Action("F", 0)]]
    with pytest.raises(RuntimeError, match="by their order"):
        simulate_exchanges(swapped)


# ---------------------------------------------------------------------------------------------- timing model
F, B, D = 0.010, 0.020, 0.025  # forward, backward seconds per micro-batch; one-way delay


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_without_delay_or_transfers_a_step_is_fill_and_drain_of_compute(build, stages, micro):
    links = [Link()] * (stages - 1)
    assert step_time(build(stages, micro), [F] * stages, [B] * stages, links) == pytest.approx(
        (micro + stages - 1) * (F + B))


@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_gpipe_pays_the_delay_once_on_the_way_down_and_once_back(stages, micro):
    links = [Link(delay_s=D)] * (stages - 1)
    assert step_time(gpipe(stages, micro), [F] * stages, [B] * stages, links) == pytest.approx(
        (micro + stages - 1) * (F + B) + 2 * (stages - 1) * D)


def test_1f1b_waits_for_more_round_trips_than_gpipe_when_micro_batches_outnumber_stages():
    links = [Link(delay_s=D)] * 3
    one, fill = step_time(one_f_one_b(4, 8), [F] * 4, [B] * 4, links), step_time(gpipe(4, 8), [F] * 4, [B] * 4, links)
    assert fill == pytest.approx(11 * (F + B) + 6 * D)
    assert one == pytest.approx(0.73)  # the run measured 0.771 s against GPipe's 0.531 s (loopback step 0.35 s)
    assert one > fill + 8 * D


def test_a_link_slower_than_compute_sets_the_pace_and_codec_work_counts_on_both_ends():
    # two stages, 8 forward messages of 50 ms on a link that is free only after the previous one
    slow = [Link(fwd_s=0.050)]
    t = step_time(gpipe(2, 8), [F] * 2, [B] * 2, slow)
    # the last forward arrives at F + 8 x 50 ms; stage 1 then runs it and 8 backwards, stage 0 the last backward
    assert t == pytest.approx(F + 8 * 0.050 + F + 8 * B + B)
    coded = [Link(fwd_codec_s=(0.003, 0.001))]  # sender 3 ms, receiver 1 ms per forward message
    assert step_time(gpipe(2, 4), [F] * 2, [B] * 2, coded) == pytest.approx(
        step_time(gpipe(2, 4), [F + 0.003, F + 0.001], [B] * 2, [Link()]))


def test_the_timing_model_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="4 stages need 4 forward and backward times and 3 links"):
        step_time(gpipe(4, 2), [F] * 4, [B] * 4, [Link()] * 2)
