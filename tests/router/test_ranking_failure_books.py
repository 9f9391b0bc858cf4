"""A call whose placement fails while ranking still closes its session's books: no call is
left in flight there, which would keep the session from ever ending."""

from __future__ import annotations

import pytest
from router_fakes import FakeInstance

from router.core import RouterCore
from talaria.protocol import CallRequest, SamplingParams


class Broken:
    """A placement policy that fails while ranking."""

    def choose(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("ranking failed")


async def test_a_call_whose_ranking_fails_leaves_no_call_in_flight_in_its_session() -> None:
    core = RouterCore({"a": FakeInstance("a", [7, 8, 9])}, Broken(), refresh_after_call=False)
    call = CallRequest(call_id="c1", session_id="s", model="m",
                       prompt_token_ids=list(range(100, 164)), params=SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="ranking failed"):
        async for _ in core.submit(call):
            pass
    record = core.sessions.get("s")
    assert record is not None and record.calls == 1 and record.active_calls == 0
    assert core.metrics.requests.get(model="m", instance="none", outcome="error") == 1
