"""Schedules are data: every send meets its receive and no stage waits forever."""

from __future__ import annotations

import pytest

from lightning_clapping.schedule import Action, forward_only, get_schedule, gpipe, messages, one_f_one_b, simulate

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
