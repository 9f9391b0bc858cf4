"""Cutting a fused decode step short: the engine keeps the steps up to the cut and gives the
rest back exactly, and a call reaching an instance mid-run is served as if the engine had
run its decode steps one by one."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import accumulate

import pytest

from engine.sim.engine import SimEngine
from talaria.instance.executor import EngineExecutor
from tests.engine.sim.sim_helpers import QWEN, drain, make, output, req, tokens
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import run_sim
from workloads.replay.systems import SYSTEMS
from workloads.traces.trace import Call, Session

LENGTHS = ((3000, 40), (5000, 55), (7000, 70))  # (prompt, answer): fused runs of many steps


def _engine(fused: int, cut: bool = True):
    engine = make(max_fused_decode_steps=fused, cut_fused_steps=cut)
    engine.activate(QWEN)
    for i, (prompt, answer) in enumerate(LENGTHS):
        engine.add_request(req(f"r{i}", tokens(prompt, 100 * i), max_tokens=answer))
    return engine


def test_a_fused_step_never_holds_a_requests_last_token() -> None:
    steps, _ = drain(_engine(64))
    fused = [s for s in steps if s.num_steps > 1]
    assert fused, "the requests decode together: some steps fuse"
    assert all(not ev.finished for s in fused for ev in s.events)


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.77, 0.999])
def test_cut_keeps_the_steps_up_to_the_first_boundary_and_changes_nothing_else(
    fraction: float,
) -> None:
    plain_steps, plain_events = drain(_engine(1))
    engine = _engine(64)
    busy_before = engine.busy_seconds  # the activation's
    steps, events = [], {}
    cuts = 0
    while engine.has_unfinished():
        step = engine.step()
        if step.num_steps > 2:
            # the plain run's step boundaries for this run's steps
            done = sum(s.num_steps for s in steps)
            ends = list(accumulate(s.seconds for s in plain_steps[done : done + step.num_steps]))
            elapsed = fraction * step.seconds
            whole = step.num_steps
            seconds = engine.cut_fused(elapsed)
            keep = next(j for j, end in enumerate(ends, 1) if end >= elapsed - 1e-12)
            assert (seconds is None) == (keep == whole)
            assert step.num_steps == keep and step.seconds == pytest.approx(ends[keep - 1])
            assert step.num_decode_tokens == keep * len(step.events)
            assert all(len(ev.new_token_ids) == keep for ev in step.events)
            cuts += seconds is not None
        steps.append(step)
        for ev in step.events:
            events.setdefault(ev.request_id, []).append(ev)
    assert (cuts > 0) == (fraction < 0.9)  # at 0.999 the moment falls in each run's last step
    # the same tokens, steps and time as one step at a time
    assert {r: output(e) for r, e in events.items()} == {
        r: output(e) for r, e in plain_events.items()}
    assert sum(s.num_steps for s in steps) == len(plain_steps)
    assert sum(s.seconds for s in steps) == pytest.approx(sum(s.seconds for s in plain_steps))
    assert engine.busy_seconds - busy_before == pytest.approx(sum(s.seconds for s in plain_steps))
    assert engine.stats().extra["num_steps"] == len(plain_steps)


def test_nothing_to_cut_after_the_last_boundary_or_in_a_single_step() -> None:
    engine = _engine(64)
    first = engine.step()  # a prefill step
    assert first.num_steps == 1 and engine.cut_fused(0.0) is None
    while (step := engine.step()).num_steps == 1:
        pass
    assert engine.cut_fused(step.seconds) is None
    assert engine.cut_fused(step.seconds * 2) is None
    with pytest.raises(ValueError):
        engine._fused.cut(step.num_steps)  # type: ignore[union-attr]


def test_without_the_option_fused_steps_run_to_their_end() -> None:
    engine = _engine(64, cut=False)
    while (step := engine.step()).num_steps == 1:
        pass
    assert engine.cut_fused(0.0) is None and step.num_steps > 1
    # and the finishing token fuses with the ones before it, as the tuned settings assume
    steps, _ = drain(_engine(64, cut=False))
    assert any(ev.finished for s in steps if s.num_steps > 1 for ev in s.events)


# A session whose second call arrives while the first session's long answer decodes.
_ONE_MODEL = ClusterSpec(models=(QWEN,), block_size=64, cut_fused_steps=True)
_TRACE = [
    Session("long", QWEN, (Call(2000, 400, None),), arrival_s=0.0),
    Session("late", QWEN, (Call(1500, 30, 1.0), Call(1700, 20, None)), arrival_s=2.37),
]


def _records(fused: int, row: str = "baseline") -> list[tuple[str, float, float, float]]:
    result = run_sim(_TRACE, SYSTEMS[row], replace(_ONE_MODEL, max_fused_decode_steps=fused))
    assert result.failed_calls == 0
    return [(s.session_id, c.sent_s, c.first_token_s or 0.0, c.done_s)
            for s in sorted(result.sessions, key=lambda s: s.session_id) for c in s.calls]


@pytest.mark.parametrize("row", ["baseline", "talaria"])
def test_a_call_arriving_mid_run_is_served_as_with_single_steps(
    row: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain, fused = _records(1, row), _records(64, row)
    assert [r[0] for r in fused] == [r[0] for r in plain]
    for got, want in zip(fused, plain, strict=True):
        assert got[1:] == pytest.approx(want[1:], rel=1e-9, abs=1e-9)
    # without the cut the late calls wait for the fused run in flight
    monkeypatch.setattr(EngineExecutor, "interrupt", lambda self: None)
    uncut = _records(64, row)
    assert any(got[2] > want[2] + 1e-3 for got, want in zip(uncut, plain, strict=True))


def _random_trace(seed: int) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for i in range(6):
        calls = []
        prompt = rng.randrange(300, 3000)
        for _ in range(rng.randrange(1, 4)):
            prompt += rng.randrange(50, 600)
            calls.append(Call(prompt, rng.randrange(2, 300), rng.uniform(0.0, 3.0)))
        calls[-1] = Call(calls[-1].input_tokens, calls[-1].output_tokens, None)
        sessions.append(Session(f"s{i}", QWEN, tuple(calls), arrival_s=rng.uniform(0.0, 20.0)))
    return sessions


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_arrivals_on_one_model_match_single_steps(
    seed: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no time-driven rule acts (one model), fusing with cuts is single steps."""
    trace = _random_trace(seed)
    cuts = []
    cut = SimEngine.cut_fused

    def counted(self: SimEngine, elapsed_s: float) -> float | None:
        seconds = cut(self, elapsed_s)
        cuts.append(seconds is not None)
        return seconds

    monkeypatch.setattr(SimEngine, "cut_fused", counted)
    for row in ("baseline", "talaria"):
        runs = [run_sim(trace, SYSTEMS[row], replace(_ONE_MODEL, max_fused_decode_steps=f))
                for f in (1, 64)]
        plain, fused = ([(c.sent_s, c.first_token_s, c.done_s, c.output_tokens)
                         for s in sorted(r.sessions, key=lambda s: s.session_id) for c in s.calls]
                        for r in runs)
        assert len(plain) == len(fused) == sum(len(s.calls) for s in trace)
        for got, want in zip(fused, plain, strict=True):
            assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert any(cuts), "some arrival fell inside a fused run"
