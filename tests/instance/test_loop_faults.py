"""The admission loop cannot die of one call: a call the engine cannot take fails alone; an
engine fault fails the calls in the engine, takes them out of it, and the loop goes on;
faults in a row without progress make it give up cleanly (every call ends, unhealthy)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from fake_engine import FakeEngine
from instance_helpers import call

from engine.interface import EngineRequest, MoveReport, Residency, StepResult
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import preset
from talaria.protocol import CallEvent, InstanceUnavailable


@dataclass
class FaultyEngine(FakeEngine):
    """Raises where told: on ``add_request`` of the ids in ``bad_ids`` (after taking the
    request, as a half-done add would), on the steps numbered in ``bad_steps``, on every
    ``activate`` of the models in ``bad_models``."""

    bad_ids: set[str] = field(default_factory=set)
    bad_steps: set[int] = field(default_factory=set)
    bad_models: set[str] = field(default_factory=set)
    steps: int = 0

    def add_request(self, request: EngineRequest) -> None:
        super().add_request(request)
        if request.request_id in self.bad_ids:
            raise TypeError("seed must be an int")

    def step(self) -> StepResult:
        self.steps += 1
        if self.steps in self.bad_steps:
            raise RuntimeError(f"device fault at step {self.steps}")
        return super().step()

    def activate(self, model: str) -> MoveReport:
        if model in self.bad_models:
            raise RuntimeError(f"cannot copy the weights of {model}")
        return super().activate(model)


def engine(**kw: object) -> FaultyEngine:
    return FaultyEngine(["a", "b"], num_blocks=200, step_s=0.1, initial_model="a", **kw)  # type: ignore[arg-type]


def test_a_call_the_engine_cannot_take_fails_alone_and_leaves_nothing_behind() -> None:
    eng = engine(bad_ids={"bad"})

    async def main() -> tuple[list[CallEvent], list[CallEvent], Instance]:
        inst = Instance("i", eng, preset("talaria"))
        await inst.start()
        good = inst.submit(call("good", "s1", "a", 20, max_tokens=4))
        bad = inst.submit(call("bad", "s2", "a", 20, max_tokens=4))
        out = await good.collect(), await bad.collect()
        after = await inst.submit(call("after", "s3", "a", 20, max_tokens=2)).collect()
        assert after[-1].finish_reason == "length"
        await inst.stop()
        return out[0], out[1], inst

    good, bad, inst = run_virtual(main())
    assert good[-1].finish_reason == "length"
    assert bad[-1].finish_reason == "error" and "TypeError" in (bad[-1].error or "")
    assert "bad" in eng.aborted  # the half-added request was taken out of the engine
    assert inst.healthy and inst.counters["engine_faults"] == 0


def test_an_engine_fault_fails_what_is_in_flight_and_the_loop_goes_on() -> None:
    eng = engine(bad_steps={3})

    async def main() -> tuple[list[list[CallEvent]], list[CallEvent], Instance]:
        inst = Instance("i", eng, preset("talaria"))
        await inst.start()
        handles = [inst.submit(call(f"c{i}", f"s{i}", "a", 20, max_tokens=10)) for i in range(2)]
        failed = [await h.collect() for h in handles]
        later = await inst.submit(call("later", "s9", "b", 20, max_tokens=3)).collect()
        await inst.stop()
        return failed, later, inst

    failed, later, inst = run_virtual(main())
    for events in failed:
        assert [e.finished for e in events].count(True) == 1
        assert events[-1].finish_reason == "error" and "device fault" in (events[-1].error or "")
    assert set(eng.aborted) == {"c0", "c1"}  # taken out of the engine, blocks freed
    assert later[-1].finish_reason == "length"  # a switch and a call after the fault
    assert inst.healthy and inst.counters["engine_faults"] == 1
    assert eng.stats().num_free_blocks == eng.num_blocks


def test_faults_in_a_row_make_the_loop_give_up_and_end_every_call() -> None:
    eng = engine(bad_models={"b"})

    async def main() -> tuple[list[CallEvent], list[CallEvent], Instance]:
        inst = Instance("i", eng, preset("talaria", max_engine_faults=3))
        await inst.start()
        b = inst.submit(call("b1", "s1", "b", 20, max_tokens=3))
        b_events = await b.collect()
        return b_events, [], inst

    b_events, _, inst = run_virtual(main())
    assert b_events[-1].finish_reason == "error" and "cannot copy" in (b_events[-1].error or "")
    assert not inst.healthy and inst.counters["engine_faults"] == 3


def test_a_loop_that_ends_on_its_own_leaves_the_instance_unhealthy_and_refusing() -> None:
    """A bug in the fault path itself ends the loop: the instance must not keep queueing
    calls nobody will ever serve."""
    eng = engine(bad_steps={1})

    async def main() -> tuple[bool, bool]:
        inst = Instance("i", eng, preset("baseline"))

        def broken(exc: Exception) -> float | None:
            raise AssertionError("a bug while handling a fault")

        inst.loop.faults.handle = broken  # type: ignore[method-assign]
        await inst.start()
        inst.submit(call("a1", "s1", "a", 20, max_tokens=3))
        await inst.wait_until_stopped()
        try:
            inst.submit(call("a2", "s2", "a", 20, max_tokens=3))
            refused = False
        except InstanceUnavailable:
            refused = True
        return inst.healthy, refused

    healthy, refused = run_virtual(main())
    assert not healthy and refused


@dataclass
class StagingFails(FaultyEngine):
    """Its copy into the staging region always fails at once; each try's loop time is kept."""

    tries: list[tuple[str, float]] = field(default_factory=list)

    def stage(self, model: str) -> MoveReport:
        self.log.append(("stage_failed", model))
        self.tries.append((model, asyncio.get_running_loop().time()))
        raise RuntimeError(f"cannot stage {model}: out of pinned memory")


def test_a_failed_staging_copy_fails_no_call_and_is_backed_off() -> None:
    """Each model's staging is tried again only after a backoff on the loop's clock, which
    doubles while its copies keep failing; no call fails and the switches copy from host."""
    eng = StagingFails(["a", "b"], num_blocks=200, step_s=0.1, initial_model="a")

    async def main() -> tuple[list[CallEvent], Instance]:
        inst = Instance("i", eng, preset("talaria").with_(staging_retry_backoff_s=0.5))
        await inst.start()
        a = inst.submit(call("a1", "s1", "a", 20, max_tokens=60))
        inst.submit(call("b1", "s2", "b", 20, max_tokens=3))  # makes b the model to stage
        events = await a.collect()
        await inst.stop()
        return events, inst

    events, inst = run_virtual(main())
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert inst.healthy and inst.counters.get("engine_faults", 0) == 0
    for model in ("a", "b"):
        times = [t for m, t in eng.tries if m == model]
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        assert all(gap >= 0.5 * 2**i for i, gap in enumerate(gaps)), (model, times)
    assert len([m for m, _ in eng.tries if m == "b"]) >= 3  # 6 s of a's decode: 0, 0.5, 1.5, 3.5
    assert inst.counters["staging_failures"] == len(eng.tries)


@dataclass
class StagingFlaky(FaultyEngine):
    """Every staging copy fails at once but those numbered in ``ok_tries`` (1-based, over
    all models); a copy that starts takes ``stage_s`` (STAGING meanwhile, then STAGED)."""

    ok_tries: set[int] = field(default_factory=set)
    tries: list[tuple[str, float]] = field(default_factory=list)
    staged_at: float = 0.0

    def stage(self, model: str) -> MoveReport:
        now = asyncio.get_running_loop().time()
        self.tries.append((model, now))
        if len(self.tries) not in self.ok_tries:
            raise RuntimeError(f"cannot stage {model}: the link dropped")
        self.staged_at = now
        return super().stage(model)

    def residency(self) -> dict[str, Residency]:
        out = super().residency()
        copying = asyncio.get_running_loop().time() < self.staged_at + self.stage_s
        return {m: Residency.STAGING if r is Residency.STAGED and copying else r
                for m, r in out.items()}


def test_a_switch_from_a_completed_staging_copy_ends_its_models_run_of_failures() -> None:
    """b's first copy fails, its retry completes while a's last call ends, and the loop
    switches to b from the staging region before any turn saw b STAGED: that copy worked, so
    b's next failure waits the first backoff again, not a doubled one."""
    eng = StagingFlaky(["a", "b"], num_blocks=200, step_s=0.1, initial_model="a", ok_tries={2})

    async def main() -> None:
        inst = Instance("i", eng, preset("talaria").with_(staging_retry_backoff_s=0.5))
        await inst.start()
        a = inst.submit(call("a1", "s1", "a", 20, max_tokens=9))  # ends while b's copy runs
        await asyncio.sleep(0.05)
        b = inst.submit(call("b1", "s2", "b", 20, max_tokens=3, last=True))
        await a.collect()
        await b.collect()
        a2 = inst.submit(call("a2", "s3", "a", 20, max_tokens=40))
        await asyncio.sleep(2.5)
        inst.submit(call("b2", "s4", "b", 20, max_tokens=3, last=True))  # b is staged again
        await a2.collect()
        await inst.stop()

    run_virtual(main())
    b = [t for m, t in eng.tries if m == "b"]
    assert eng.tries[1][0] == "b" and ("activate", "b") in eng.log  # the copy that worked
    assert len(b) >= 4, eng.tries
    assert b[3] - b[2] < 2 * 0.5, b  # a first failure again: one backoff, not two
