"""The step deadline follows measured steps: cold at first, then p99-based, floored and capped."""

from __future__ import annotations

import pytest

from kvmesh.services.contracts.step_deadline import StepDeadline, StepDeadlinePolicy

POLICY = StepDeadlinePolicy(min_s=1.0, p99_factor=20.0, cold_s=60.0, window=100, warm_steps=4)


def _warmed_up() -> StepDeadline:
    deadline = StepDeadline(POLICY)
    for _ in range(POLICY.warm_steps):
        assert deadline.for_step(1) == 60.0
        deadline.record(2.0, 1)  # cold steps are slow, and left out
    return deadline


def test_cold_steps_get_the_cold_deadline_and_are_not_measured() -> None:
    deadline = _warmed_up()
    assert deadline.for_step(1) == 60.0  # nothing measured yet
    deadline.record(0.5, 1)
    assert deadline.for_step(1) == pytest.approx(10.0)  # 20 x 0.5 s, not 20 x 2 s
    deadline.reset()
    assert deadline.for_step(1) == 60.0
    deadline.record(0.5, 1)
    assert deadline.for_step(1) == 60.0  # cold again after a reset


def test_p99_times_factor_floored_by_the_minimum() -> None:
    deadline = _warmed_up()
    for _ in range(99):
        deadline.record(0.02, 4)
    assert deadline.for_step(4) == 1.0  # 20 x 0.02 s = 0.4 s: the floor
    deadline.record(0.2, 4)  # one slow step among 100 is the p99
    assert deadline.for_step(4) == pytest.approx(4.0)


def test_a_step_bigger_than_any_measured_gets_proportionally_more_up_to_the_cap() -> None:
    deadline = _warmed_up()
    for _ in range(10):
        deadline.record(0.1, 16)
    assert deadline.for_step(16) == pytest.approx(2.0)
    assert deadline.for_step(64) == pytest.approx(8.0)
    assert deadline.for_step(2048) == 60.0


def test_policy_refuses_a_floor_above_the_cap() -> None:
    with pytest.raises(ValueError):
        StepDeadlinePolicy(min_s=10.0, cold_s=5.0)
