"""A slot that yields to an outranking model switches to it, and two models never outrank
each other.

The priority switch (``talaria.instance.slot_yield``) weighed the active model by the sessions
its slot serves but a waiting model by its calls, and the next-model rule (``next_model``)
weighs both by calls. One session with several calls queued for each of two models (an
agent's parallel calls, found live by sending eight calls under one ``X-Session-ID`` to two
models) made them disagree: the slot closed as outranked, the next model was the active one,
its slot reopened and closed again, and the admission loop spun without ever awaiting, so the
instance answered nothing (not even the router's state polls or aborts) until it was killed."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine
from instance_helpers import Timed, call, run_call

from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.instance.loop import AdmissionLoop
from talaria.policies.config import preset


class _Spun(BaseException):
    """Raised out of the admission loop (past its fault handling) once it spins."""


def _spin_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reopening a slot many times at one loop time is the spin, and dozens of switches for
    eight short calls the ping-pong: fail them instead of hanging."""
    reopened: dict[float, int] = {}
    switches = [0]
    original = AdmissionLoop._open_slot
    original_switch = AdmissionLoop._switch

    async def counted(self: AdmissionLoop, model: str) -> None:
        switches[0] += 1
        if switches[0] > 50:
            raise _Spun(f"{switches[0]} switches, the last to {model!r}")
        await original_switch(self, model)

    def guarded(self: AdmissionLoop, model: str, switch_s: float = 0.0):  # type: ignore[no-untyped-def]
        now = self.now()
        reopened[now] = reopened.get(now, 0) + 1
        if reopened[now] > 100:
            raise _Spun(f"slot of {model!r} reopened 100 times at t={now}")
        return original(self, model, switch_s)

    monkeypatch.setattr(AdmissionLoop, "_open_slot", guarded)
    monkeypatch.setattr(AdmissionLoop, "_switch", counted)


@pytest.mark.parametrize("b_sessions", [("s", "s", "s"), ("t", "u")])
def test_one_sessions_parallel_calls_on_two_models_do_not_spin_the_loop(
    monkeypatch: pytest.MonkeyPatch, b_sessions: tuple[str, ...],
) -> None:
    """Session s runs one call of model a and queues four more; b's calls are s's too (the
    two rules then ranked each model first: a slot ping-pong once the switch was taken), or
    those of two sessions (b outranks a's lone session, while a has more calls waiting)."""
    _spin_guard(monkeypatch)
    # min_slot_factor 0: a slot may yield at once, as it does live for a model whose switch
    # the instance has not timed yet (its estimate is 0 s)
    policy = preset("talaria", min_slot_factor=0.0, soft_reservations=False)

    async def main() -> tuple[list[Timed], bool]:
        inst = Instance("i", FakeEngine(["a", "b"], step_s=0.1), policy)
        await inst.start()
        try:
            first = asyncio.create_task(run_call(inst, call("a0", "s", "a", 40, max_tokens=5)))
            await asyncio.sleep(0.15)  # a0 runs; the rest of the session's calls queue
            rest = [asyncio.create_task(run_call(inst, call(f"a{i}", "s", "a", 40 + i)))
                    for i in range(1, 5)]
            rest += [asyncio.create_task(run_call(inst, call(f"b{i}", sid, "b", 40 + i)))
                     for i, sid in enumerate(b_sessions)]
            done = await asyncio.wait_for(asyncio.gather(first, *rest), timeout=120.0)
            return done, inst.healthy
        finally:
            await inst.stop()

    calls, healthy = run_virtual(main())
    assert healthy
    assert all(t.last.finish_reason == "length" for t in calls)
