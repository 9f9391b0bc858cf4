"""The supervisor of `talaria serve`: a dead instance is started again with a doubling
backoff while it dies young, a start that fails is retried, and none of it ends serving."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from talaria.serving.supervisor import RestartPolicy, Supervisor


@dataclass
class Child:
    id: str
    ready_file: Path
    url: str | None = None
    code: int | None = None
    pid: int = 1

    def exit_code(self) -> int | None:
        return self.code


def make(tmp_path: Path, failures: int = 0) -> tuple[Supervisor[Child], list[str]]:
    spawned: list[str] = []
    left = [failures]

    def spawn(instance_id: str) -> Child:
        if left[0] > 0:
            left[0] -= 1
            raise OSError(24, "Too many open files")
        spawned.append(instance_id)
        return Child(instance_id, tmp_path / f"{instance_id}.ready")

    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=4.0, healthy_after_s=60.0)
    sup = Supervisor([Child("a", tmp_path / "a.ready")], spawn, policy)
    return sup, spawned


def test_a_dead_instance_restarts_after_a_backoff_that_doubles_while_it_dies_young(
    tmp_path: Path,
) -> None:
    sup, spawned = make(tmp_path)
    sup._started["a"] = 0.0
    for death, (at, delay) in enumerate([(1.0, 0.5), (2.0, 1.0), (4.0, 2.0), (8.0, 4.0)]):
        sup.children[0].code = 1
        sup.check(at)  # noticed: scheduled
        sup.check(at + delay - 0.01)
        assert len(spawned) == death
        sup.check(at + delay)
        assert len(spawned) == death + 1 and sup.children[0].code is None
    assert sup.restarts["a"] == 4


def test_a_start_that_fails_is_tried_again_instead_of_ending_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sup, spawned = make(tmp_path, failures=2)
    sup._started["a"] = 0.0
    sup.children[0].code = 1
    sup.check(1.0)
    sup.check(1.5)  # due: the start fails
    sup.check(2.5)  # the next backoff (1 s): fails again
    assert spawned == [] and "could not be started" in capsys.readouterr().err
    sup.check(4.5)  # then 2 s: starts
    assert spawned == ["a"] and sup.restarts["a"] == 1


def test_an_instance_that_keeps_dying_young_is_restarted_for_as_long_as_it_takes(
    tmp_path: Path,
) -> None:
    """The backoff stays at its cap however many times the instance has died young: a
    process that crash-loops for hours (a broken device) never ends `talaria serve`."""
    sup, spawned = make(tmp_path)
    sup._started["a"] = 0.0
    sup._young_deaths["a"] = 5000  # past 1024 the doubling overflowed a float (8.5 h at 30 s)
    sup.children[0].code = 1
    sup.check(1.0)
    sup.check(1.0 + sup.policy.max_delay_s)
    assert spawned == ["a"]
    assert RestartPolicy().delay(10**6) == RestartPolicy().max_delay_s
