"""Host KV: a session whose model was switched out restores its KV instead of recomputing."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine
from instance_helpers import call, run_call, run_session

from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import preset


@pytest.mark.parametrize("policy_name", ["+host_kv", "+staging"])
def test_returning_session_restores_instead_of_recomputing(policy_name: str) -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0, switch_staged_s=0.2)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset(policy_name))
        await inst.start()
        s = asyncio.ensure_future(run_session(inst, "s", "a", 2, gap=1.0))
        await asyncio.sleep(2.2)
        b = await run_call(inst, call("b0", "sb", "b", 50, 5, last=True))
        away = inst.state()
        out = await s, b
        await inst.stop()
        return out, away

    (s, b), away = run_virtual(main())
    assert engine.log.index(("activate", "b")) < engine.log.index(("add", "s-1"))
    usage = s[1].last.usage
    assert usage is not None and usage.prompt_tokens == 125
    # The first event with tokens carries the prompt's usage too (a router that stops reading
    # at a stop string has it); the events between carry none.
    first, *between = [e for e in s[1].events[:-1] if e.token_ids]
    assert first.usage is not None and all(e.usage is None for e in between)
    assert ((first.usage.prompt_tokens, first.usage.cached_tokens, first.usage.restored_tokens)
            == (usage.prompt_tokens, usage.cached_tokens, usage.restored_tokens))
    if policy_name == "+host_kv":
        assert away.sessions["s"].host_tokens == 105 and away.sessions["s"].device_tokens == 0
        assert usage.restored_tokens == 105 and usage.cached_tokens == 105
        assert engine.restored_tokens == 105
        assert engine.prefilled_tokens == 100 + 50 + 20
        assert away.kv_offloaded_bytes == 105 * engine.kv_token_bytes
    else:
        kv = away.sessions.get("s")  # listed only for its reservation: no KV anywhere
        assert kv is None or (kv.device_tokens, kv.host_tokens) == (0, 0)
        assert usage.restored_tokens == 0 and usage.cached_tokens == 0
        assert engine.restored_tokens == 0
        assert engine.prefilled_tokens == 100 + 50 + 125
