"""A session whose call moves to another instance has its soft reservation released where
it ran before (that promise of a return would otherwise feed the instance's scheduling until
it expired); the session itself is not forgotten there, so its KV stays for a bounce back."""

from __future__ import annotations

from router_fakes import FakeInstance

from router.core import RouterCore
from talaria.protocol import CallRequest, SamplingParams


class Asked(FakeInstance):
    def __init__(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **k)
        self.forgotten: list[str] = []
        self.released: list[str] = []

    def forget_sessions(self, ids) -> None:  # type: ignore[no-untyped-def]
        self.forgotten.extend(ids)

    def release_reservations(self, ids) -> None:  # type: ignore[no-untyped-def]
        self.released.extend(ids)


def _call(i: int, prompt: list[int]) -> CallRequest:
    return CallRequest(call_id=f"c{i}", session_id="s", model="m", prompt_token_ids=prompt,
                       params=SamplingParams(max_tokens=3))


async def _run(core: RouterCore, call: CallRequest) -> str:
    placed = ""
    async for event in core.submit(call):
        placed = event.instance_id or placed
    return placed


async def test_a_session_that_moves_is_released_where_it_ran_before() -> None:
    a, b = Asked("a", [7, 8, 9]), Asked("b", [7, 8, 9])
    instances = {"a": a, "b": b}
    core = RouterCore(instances, "load", refresh_after_call=False)
    prompt = list(range(100, 164))
    first = await _run(core, _call(1, prompt))
    prompt += [7, 8, 9] + list(range(200, 216))
    again = await _run(core, _call(2, prompt))
    assert again == first and a.released == b.released == []  # stayed: nothing to release
    core.mark_down(first, "test: its process stopped")
    prompt += [7, 8, 9] + list(range(300, 316))
    moved = await _run(core, _call(3, prompt))
    assert moved != first
    assert instances[first].released == ["s"] and instances[first].forgotten == []
    assert instances[moved].released == instances[moved].forgotten == []


async def test_a_session_that_ends_is_forgotten_on_every_instance_it_ran_on() -> None:
    """The instance it left holds its KV (released, still cached) and its history: its end
    frees them there too, not only where its last call ran."""
    a, b = Asked("a", [7, 8, 9]), Asked("b", [7, 8, 9])
    instances = {"a": a, "b": b}
    core = RouterCore(instances, "load", refresh_after_call=False)
    prompt = list(range(100, 164))
    first = await _run(core, _call(1, prompt))
    core.mark_down(first, "test: its process stopped")
    prompt += [7, 8, 9] + list(range(300, 316))
    moved = await _run(core, _call(2, prompt))
    prompt += [7, 8, 9] + list(range(400, 416))
    last = CallRequest(call_id="c3", session_id="s", model="m", prompt_token_ids=prompt,
                       params=SamplingParams(max_tokens=3), last_call=True)
    assert await _run(core, last) == moved
    assert instances[first].forgotten == ["s"] and instances[moved].forgotten == ["s"]
