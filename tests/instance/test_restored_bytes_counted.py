"""The KV a call restored from the host store counts in the instance's ``kv_restored_bytes``
however the call ends: finished, aborted by its client, or ended once answered."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from instance_helpers import call, run_call

from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import preset


@pytest.mark.parametrize("end", ["finished", "aborted", "answered"])
def test_a_restored_call_counts_its_bytes_however_it_ends(end: str) -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("+host_kv"))
        await inst.start()
        await run_call(inst, call("s-0", "s", "a", 100, 5, gap=1.0))
        await run_call(inst, call("b0", "sb", "b", 50, 5, last=True))  # s's KV goes to host
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
