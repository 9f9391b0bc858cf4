"""The KV a call restored from the host store counts in the instance's ``kv_restored_bytes``
however the call ends: finished, aborted by its client, or ended once answered, and aborted
before its first event (restored, then inside a chunked prefill that sends none)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from fake_engine import FakeEngine
from instance_helpers import call, run_call

from engine.interface import StepResult
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import preset


async def _session_on_host(engine: FakeEngine) -> Instance:
    """A started instance where session ``s`` (model a) has had a call and its 105 tokens of
    KV went to host when model b's call came."""
    inst = Instance("i", engine, preset("+host_kv"))
    await inst.start()
    await run_call(inst, call("s-0", "s", "a", 100, 5, gap=1.0))
    await run_call(inst, call("b0", "sb", "b", 50, 5, last=True))
    return inst


@pytest.mark.parametrize("end", ["finished", "aborted", "answered"])
def test_a_restored_call_counts_its_bytes_however_it_ends(end: str) -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = await _session_on_host(engine)
        reasons = []
        async for event in inst.submit(call("s-1", "s", "a", 125, 50)):
            reasons.append(event.finish_reason)
            if event.token_ids and end != "finished" and len(reasons) == 2:
                assert inst.abort("s-1", answered=end == "answered")
        state = inst.state()
        await inst.stop()
        return reasons[-1], state

    last, state = run_virtual(main())
    assert last == {"finished": "length", "aborted": "abort", "answered": "stop"}[end]
    assert engine.restored_tokens == 105
    assert state.kv_restored_bytes == 105 * engine.kv_token_bytes


@dataclass
class ChunkedPrefillEngine(FakeEngine):
    """Request ``slow`` restores (or prefills) at its first step, as every request does, but
    its prefill then takes ``chunks`` more steps with no event, as a chunked prefill does."""

    slow: str = "s-1"
    chunks: int = 20
    _left: int = -1

    def step(self) -> StepResult:
        req = self._reqs.get(self.slow)
        if req is not None and not req.started:
            self._start(req)
            self._left = self.chunks
        if req is not None and self._left > 0:
            self._left -= 1
            return self.step_without(self.slow)
        return super().step()


def test_a_call_aborted_while_prefilling_after_a_restore_counts_its_restored_bytes() -> None:
    engine = ChunkedPrefillEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = await _session_on_host(engine)
        handle = inst.submit(call("s-1", "s", "a", 125, 50))
        while engine.restored_tokens == 0:
            await asyncio.sleep(0.05)
        assert inst.abort("s-1")
        events = await handle.collect()
        state = inst.state()
        await inst.stop()
        return events, state

    events, state = run_virtual(main())
    assert events[-1].finish_reason == "abort" and not any(e.token_ids for e in events)
    assert engine.restored_tokens == 105
    assert state.kv_restored_bytes == 105 * engine.kv_token_bytes
