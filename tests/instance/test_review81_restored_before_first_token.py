"""Review 81: "a call's host-restored KV counts in kv_restored_bytes however it ends" (a246ebc)
holds only for a call that had an event. A call whose engine restored its KV from the host
and is still prefilling (a chunked prefill sends no event until its last chunk) has no
``pending.usage`` yet; aborted (or failed by an engine fault) then, its restored bytes are
in the engine's ``restored_tokens_total`` but never in the instance's ``kv_restored_bytes``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fake_engine import FakeEngine
from instance_helpers import call, run_call

from engine.interface import StepResult
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import preset


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
            del self._reqs[self.slow]
            try:
                return super().step()
            finally:
                self._reqs[self.slow] = req
        return super().step()


def test_a_call_aborted_while_prefilling_after_a_restore_counts_its_restored_bytes() -> None:
    engine = ChunkedPrefillEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("+host_kv"))
        await inst.start()
        await run_call(inst, call("s-0", "s", "a", 100, 5, gap=1.0))
        await run_call(inst, call("b0", "sb", "b", 50, 5, last=True))  # s's KV goes to host
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
