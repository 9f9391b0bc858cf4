"""Sessions from what coding agents send (Claude Code, Codex, OpenCode headers; Anthropic
metadata), a subagent's first call placed with its parent, the session-final hint; and
sessions inferred from prompts when nothing names one."""

from __future__ import annotations

import pytest
from api_helpers import chat_body, reply, serve
from multidict import CIMultiDict
from router_fakes import FakeInstance, book_call

from router.api.anthropic_schema import metadata_session_id
from router.app import CORE_KEY
from router.core import RouterCore
from router.limits import RouterLimits
from router.sessions.identity import SessionHeaders, SessionIdentity, resolve_session
from router.sessions.inference import SessionInference
from router.sessions.table import SessionTable
from router.tokenization import ModelTokenizer
from talaria.protocol import CallRequest, InstanceState, SamplingParams, SessionKV
from talaria.protocol.errors import ApiError
from talaria.protocol.text import block_hashes


def _resolve(headers: dict[str, str], **kw: object) -> SessionIdentity:
    return resolve_session(CIMultiDict(headers), **kw)  # type: ignore[arg-type]


def test_agent_headers_name_sessions_and_parents() -> None:
    assert _resolve({"X-Claude-Code-Session-Id": "cc"}) == SessionIdentity("cc", None, False, "x-claude-code-session-id")
    sub = _resolve({"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "a1"})
    assert (sub.session_id, sub.parent_id) == ("cc:a1", "cc")  # agent ids are scoped by session
    nested = _resolve({"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "a2",
                       "x-claude-code-parent-agent-id": "a1"})
    assert (nested.session_id, nested.parent_id) == ("cc:a2", "cc:a1")
    assert _resolve({"session-id": "codex-1"}).session_id == "codex-1"
    assert _resolve({"session_id": "codex-0"}).session_id == "codex-0"  # older Codex
    opencode = _resolve({"X-Session-Id": "oc-2", "x-session-affinity": "oc-2", "x-parent-session-id": "oc-1"})
    assert (opencode.session_id, opencode.parent_id, opencode.source) == ("oc-2", "oc-1", "x-session-id")
    assert _resolve({"x-session-affinity": "oc-3"}).session_id == "oc-3"
    assert _resolve({"x-session-id": "mine", "x-claude-code-session-id": "cc"}).session_id == "mine"
    assert _resolve({"x-claude-code-session-id": "cc"}, body_session_id="body").session_id == "body"
    assert _resolve({}, body_hint="meta").session_id == "meta"
    assert _resolve({"x-claude-code-session-id": "cc"}, body_hint="meta").session_id == "cc"
    assert _resolve({}) == SessionIdentity(None)
    assert _resolve({"x-dynamo-session-final": "true", "x-dynamo-session-id": "d"}).final
    assert _resolve({}, last_call=True).final
    custom = SessionHeaders(session=("x-my-session",), parent=(), final=(), scoped=())
    assert resolve_session(CIMultiDict({"X-My-Session": "m", "x-session-id": "ignored"}), names=custom).session_id == "m"


def test_configured_header_names_are_case_insensitive_like_http_headers() -> None:
    """``[router] session_headers`` replaces the list with names as the user spells them;
    HTTP header names are case-insensitive, but a name spelled ``X-Claude-Code-Agent-Id``
    missed the lowercase scoping rules, so two sessions' subagent "a1" became one session
    (with no parent), and ``X-Session-ID`` (as the docs spell it) skipped the check that it
    agrees with the body's session_id."""
    names = SessionHeaders(session=("X-Session-ID", "X-Claude-Code-Agent-Id", "X-Claude-Code-Session-Id"))
    sub = _resolve({"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "a1"}, names=names)
    assert (sub.session_id, sub.parent_id) == ("cc:a1", "cc")
    with pytest.raises(ApiError, match="disagree"):
        _resolve({"x-session-id": "a"}, body_session_id="b", names=names)


@pytest.mark.parametrize("headers, body, match", [
    ({"x-session-id": "a"}, "b", "disagree"),
    ({"x-claude-code-session-id": " "}, None, "empty"),
    ({"session-id": "x" * 300}, None, "printable ASCII"),
    ({"x-talaria-session-final": "maybe"}, None, "true or false"),
])
def test_bad_session_sources_are_400(headers: dict[str, str], body: str | None, match: str) -> None:
    with pytest.raises(ApiError, match=match) as info:
        _resolve(headers, body_session_id=body)
    assert info.value.status == 400


def test_claude_code_metadata_user_id() -> None:
    assert metadata_session_id({"user_id": '{"device_id": "d", "account_uuid": "", "session_id": "s-9"}'}) == "s-9"
    assert metadata_session_id({"user_id": "user_abc_account_42_session_0d1e-77"}) == "0d1e-77"
    assert metadata_session_id({"user_id": "someone"}) is None


def test_only_claude_codes_user_id_shape_names_a_session() -> None:
    """An Anthropic SDK user's ``metadata.user_id`` is its own end-user id, no session: one
    that merely contains ``_session_`` (``alice_session_1``, ``bob_session_1``) was cut at it,
    so two users' conversations became one session "1" (and a non-ASCII tail a 400)."""
    assert metadata_session_id({"user_id": "alice_session_1"}) is None
    assert metadata_session_id({"user_id": "team_b_session_1"}) is None
    assert metadata_session_id({"user_id": "acme_session_caf\u00e9"}) is None
    legacy = "user_" + "ab12" * 16 + "_account_" + "_session_" + "9f0e-1"  # no account: Claude Code's
    assert metadata_session_id({"user_id": legacy}) == "9f0e-1"
    assert metadata_session_id(None) is None


async def test_headers_over_http_subagent_placed_with_parent_and_final_hint(tokenizer: ModelTokenizer) -> None:
    a, b = FakeInstance("a", reply(tokenizer)), FakeInstance("b", reply(tokenizer))
    async with serve(tokenizer, {"a": a, "b": b}) as client:
        core = client.server.app[CORE_KEY]
        core.context.add("a", 0, 10**6)  # a is busy: the parent's first call goes to b
        parent = {"x-claude-code-session-id": "cc"}
        resp = await client.post("/v1/chat/completions", json=chat_body(), headers=parent)
        assert resp.status == 200 and resp.headers["X-Session-ID"] == "cc" and b.calls[-1].session_id == "cc"
        core.context.remove("a", 10**6)  # a and b are equal now; a would win the tie by name
        other = {"x-claude-code-session-id": "cc2"}
        await client.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": "x"}]),
                          headers=other)
        assert a.calls[-1].session_id == "cc2"
        sub = {**parent, "x-claude-code-agent-id": "explore-1"}
        await client.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": "sub"}]),
                          headers=sub)
        assert b.calls[-1].session_id == "cc:explore-1" and b.calls[-1].parent_session_id == "cc"
        await client.post("/v1/chat/completions", json=chat_body(),
                          headers={**parent, "x-talaria-session-final": "true"})
        assert b.calls[-1].last_call and "cc" not in core.sessions and "cc2" in core.sessions


async def test_a_subagent_goes_where_its_parent_kv_is_on_host() -> None:
    """The parent's KV, reported in host memory on b, draws its subagent's first call (which
    repeats the parent's prompt) to b although b is busier; without the parent id, a wins."""
    prompt = list(range(1, 200))
    for parent_id, expected in (("p", "b"), (None, "a")):
        a, b = FakeInstance("a", [5, 6]), FakeInstance("b", [5, 6])
        core = RouterCore({"a": a, "b": b}, "talaria", refresh_after_call=False, block_size=16)
        book_call(core.sessions, "p", prompt, 0.0, 1.0, instance="b")
        for iid in ("a", "b"):
            core.update_state(InstanceState(iid, block_size=16))
        core.states["b"].sessions["p"] = SessionKV("p", "m", host_tokens=len(prompt))
        core.context.add("b", 50, 50)
        child = CallRequest("c1", "child", "m", prompt + [7, 8], SamplingParams(max_tokens=2),
                            parent_session_id=parent_id)
        events = [e async for e in core.submit(child)]
        assert events[-1].instance_id == expected


def test_inference_joins_continuations_and_keeps_sessions_apart() -> None:
    inf = SessionInference(block_size=4)

    def assign(prompt: list[int], model: str = "m") -> str:
        return inf.assign(model, prompt, block_hashes(prompt, 4))

    system = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # every session starts with the same system prompt
    s1 = assign(system + [20, 21])
    s2 = assign(system + [30])
    assert s1 != s2  # sharing a system prompt is not continuing a session
    inf.record_answer(s1, [22, 23])
    assert assign(system + [20, 21, 22, 23, 24, 25, 26]) == s1
    assert assign(system + [30, 31, 32]) == s2
    assert assign(system + [30, 31, 32]) == s2  # a retry of the same prompt
    assert assign(system + [20, 21, 22, 23, 24, 25, 26, 99], model="other") not in (s1, s2)
    assert assign([1, 2]) not in (s1, s2) and assign([1, 2, 3]) == assign([1, 2, 3, 4, 5, 6, 7])  # short
    # Two sessions with equal prompts: the one whose answer the prompt repeats wins.
    t1, t2 = assign([50, 51, 52, 53, 54]), "?"
    inf.record_answer(t1, [60])
    t2 = inf.assign("m", [50, 51, 52, 53, 54], block_hashes([50, 51, 52, 53, 54], 4))
    assert t2 == t1
    inf.forget(s1)
    assert assign(system + [20, 21, 22, 23, 24, 25, 26, 27]) != s1
    small = SessionInference(block_size=4, max_sessions=2)
    ids = [small.assign("m", [k] * 5, block_hashes([k] * 5, 4)) for k in range(3)]
    assert len(small) == 2 and ids[0] not in small


async def test_inferred_sessions_over_http(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    messages = [{"role": "user", "content": "Fix the failing test"}]
    async with serve(tokenizer, {"a": a}) as client:
        ids = []
        for turn in range(3):
            resp = await client.post("/v1/chat/completions", json=chat_body(messages=messages))
            data = await resp.json()
            ids.append(resp.headers["X-Session-ID"])
            messages = messages + [data["choices"][0]["message"], {"role": "user", "content": f"result {turn}"}]
        other = await client.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": "hi"}]))
        assert ids == [ids[0]] * 3 and other.headers["X-Session-ID"] != ids[0]
    assert [c.last_call for c in a.calls] == [True, False, False, True]  # first calls: tentative
    async with serve(tokenizer, {"a": a}, infer_sessions=False) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.headers["X-Session-ID"].startswith("anon-") and a.calls[-1].last_call


async def test_a_session_evicted_from_a_full_table_leaves_inference_and_counts_its_sct() -> None:
    a = FakeInstance("a", [5, 6])
    core = RouterCore({"a": a}, "talaria", refresh_after_call=False, block_size=4,
                      sessions=SessionTable(max_sessions=2), inference=SessionInference(4))
    named = []
    for k in range(3):
        call = CallRequest(f"c{k}", "", "m", [k + 1] * 9, SamplingParams(max_tokens=2))
        [e async for e in core.submit(call)]
        named.append(call.session_id)
    assert named[0] not in core.sessions and named[0] not in core.inference
    assert len(core.inference) == 2 and core.metrics.sct.count(model="m") == 1
    await core.close()


async def test_inference_holds_as_many_sessions_as_the_table(tokenizer: ModelTokenizer) -> None:
    async with serve(tokenizer, {"a": FakeInstance("a", reply(tokenizer))},
                     limits=RouterLimits(max_sessions=5)) as client:
        core = client.server.app[CORE_KEY]
        assert core.inference.max_sessions == core.sessions.max_sessions == 5


async def test_an_inferred_session_is_tentative_until_a_second_call_continues_it() -> None:
    """Its first call reaches the instance as a last call (no reservation for a one-shot
    call); the router keeps the session, so the continuation joins it and is not last."""
    a = FakeInstance("a", [5, 6])
    core = RouterCore({"a": a}, "talaria", refresh_after_call=False, block_size=4,
                      inference=SessionInference(4))
    prompts = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 9, 5, 6, 7], [1, 2, 3, 4, 9, 5, 6, 7, 5, 6, 8],
               [40, 41, 42, 43, 44]]
    for k, prompt in enumerate(prompts):
        [e async for e in core.submit(CallRequest(f"c{k}", "", "m", prompt, SamplingParams(max_tokens=2)))]
    sent = [(c.session_id, c.last_call) for c in a.calls]
    first = sent[0][0]
    assert sent[:3] == [(first, True), (first, False), (first, False)]
    assert sent[3][0] != first and sent[3][1]
    assert first in core.sessions and sent[3][0] in core.sessions
    ended = CallRequest("c9", "", "m", prompts[2] + [5, 6, 1], SamplingParams(max_tokens=2), last_call=True)
    [e async for e in core.submit(ended)]
    assert ended.session_id == first and first not in core.sessions and first not in core.inference
    await core.close()


async def test_an_inferred_session_never_takes_the_name_of_a_client_named_one() -> None:
    """``inferred-<n>`` counts from 0 in every router process, and a client may name its
    session so (one that kept the X-Session-ID a router gave it before a restart): a new
    conversation inferred as ``inferred-0`` joined that client's session, so either one's
    last call ended both, and the other's KV was forgotten on its instance."""
    a = FakeInstance("a", [5, 6])
    core = RouterCore({"a": a}, "talaria", refresh_after_call=False, block_size=4,
                      inference=SessionInference(4))
    named = CallRequest("c0", "inferred-0", "m", [1, 2, 3, 4, 9], SamplingParams(max_tokens=2))
    [e async for e in core.submit(named)]
    anonymous = CallRequest("c1", "", "m", [40, 41, 42, 43, 44], SamplingParams(max_tokens=2), last_call=True)
    [e async for e in core.submit(anonymous)]
    assert anonymous.session_id not in ("", "inferred-0")
    record = core.sessions.get("inferred-0")
    assert record is not None and record.calls == 1 and len(record.branches) == 1
    await core.close()
