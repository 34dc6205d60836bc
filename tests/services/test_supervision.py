"""The launcher's restart budget is a rate; liveness misses count only after a first answer."""

from __future__ import annotations

from kvmesh.services.cli.supervision import LivenessWatch, RestartBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_restarts_are_limited_per_window_not_per_lifetime() -> None:
    clock = Clock()
    budget = RestartBudget(max_restarts=2, window_s=60.0, clock=clock)
    assert budget.try_restart() and budget.try_restart()
    assert not budget.try_restart()  # a crash loop stops the launcher
    clock.now = 61.0
    assert budget.try_restart()  # rare failures keep being healed
    assert budget.recent == 1
    for _ in range(10):
        clock.now += 31.0
        assert budget.try_restart()


def test_a_child_is_hung_after_consecutive_misses_once_it_has_answered() -> None:
    clock = Clock()
    watch = LivenessWatch(period_s=5.0, failures=3, clock=clock)
    assert not watch.due()
    clock.now = 5.0
    assert watch.due()
    assert not any(watch.record(False) for _ in range(10))  # still starting
    assert not watch.record(True)
    assert not watch.record(False) and not watch.record(False)
    assert not watch.record(True)  # an answer resets the count
    assert [watch.record(False) for _ in range(3)] == [False, False, True]
    watch.restarted()
    assert not watch.record(False)  # a restarted child starts again


def test_period_zero_turns_probes_off() -> None:
    clock = Clock()
    watch = LivenessWatch(period_s=0.0, clock=clock)
    clock.now = 1e6
    assert not watch.due()
