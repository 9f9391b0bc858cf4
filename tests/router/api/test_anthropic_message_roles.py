"""Which roles ``/v1/messages`` takes in ``messages``, and which blocks each role may hold.

Anthropic's Messages API puts the system prompt in the top-level ``system`` field. A message
of role ``system`` in ``messages`` is Anthropic's mid-conversation system message: documented
after a user turn, never as the first message (Anthropic answers that with a 400 telling the
client to use the top-level field), and the form with no content (a directive) anywhere.
Claude Code (2.1.154 on, checked with 2.1.197) sends one after the task's user turn on every
call, so that form must keep working. A ``tool_use`` block is what an assistant wrote and a
``tool_result`` answers it from the user's side: elsewhere they were dropped without a word.
"""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import scripted, serve

from router.tokenization import ModelTokenizer

USER = {"role": "user", "content": "Weather in Paris?"}
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}
AGENTS = "Available agent types for the Agent tool: general-purpose"


async def _post(tok: ModelTokenizer, path: str, body: dict[str, Any]) -> tuple[int, Any, int]:
    """The status, the JSON answer and how many calls reached the instance."""
    instance = scripted(tok, "ok")
    async with serve(tok, {"i0": instance}) as client:
        resp = await client.post(path, json={"model": "tiny", "max_tokens": 20, "tools": TOOLS, **body})
        return resp.status, await resp.json(), len(instance.calls)


def _refused(status: int, answer: Any, calls: int) -> str:
    """The message of an Anthropic-shaped 400 that no instance saw."""
    assert status == 400 and calls == 0, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    return str(answer["error"]["message"])


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_a_system_message_first_is_a_400_pointing_to_the_system_field(
    tiny_tokenizer: ModelTokenizer, path: str,
) -> None:
    """It was taken as the system prompt: a client that put its system prompt where OpenAI's
    chat API takes it got a 200 here and a 400 from Anthropic."""
    body = {"messages": [{"role": "system", "content": "Be brief."}, USER]}
    message = _refused(*await _post(tiny_tokenizer, path, body))
    assert "messages[0]" in message and "'system'" in message and "top-level system field" in message


async def test_claude_codes_system_message_after_the_user_turn_is_taken(tiny_tokenizer: ModelTokenizer) -> None:
    """Claude Code's own shape (its agent list as a system message after the task), through
    a tool round trip: a 200, and the text reaches the prompt."""
    instance = scripted(tiny_tokenizer, "ok")
    messages = [USER, {"role": "system", "content": AGENTS},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, CALL]},
                {"role": "user", "content": [RESULT]}]
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 20, "system": "Be brief.", "tools": TOOLS, "messages": messages})
        assert resp.status == 200, await resp.text()
    assert AGENTS in tiny_tokenizer.tokenizer.decode(instance.calls[0].prompt_token_ids)


@pytest.mark.parametrize("at", [0, 1])
async def test_a_system_message_without_content_adds_nothing(tiny_tokenizer: ModelTokenizer, at: int) -> None:
    """Anthropic takes the directive form (``content: []``) at any position, the first too;
    it has no text, so the prompt is the one without it (it added an empty system prompt
    part, or an empty user turn)."""
    instance = scripted(tiny_tokenizer, "ok", "ok")
    messages = [USER, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go on."}]
    with_directive = [*messages]
    with_directive.insert(at, {"role": "system", "content": []})
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        for msgs in (messages, with_directive):
            resp = await client.post("/v1/messages", json={
                "model": "tiny", "max_tokens": 20, "system": "Be brief.", "messages": msgs})
            assert resp.status == 200, await resp.text()
    assert instance.calls[1].prompt_token_ids == instance.calls[0].prompt_token_ids


async def test_messages_of_only_directives_are_a_400(tiny_tokenizer: ModelTokenizer) -> None:
    message = _refused(*await _post(tiny_tokenizer, "/v1/messages", {"messages": [{"role": "system", "content": []}]}))
    assert "user or assistant message" in message


@pytest.mark.parametrize("role", ["bot", "tool", "developer"])
async def test_an_unknown_role_is_a_400_naming_the_index_and_the_role(
    tiny_tokenizer: ModelTokenizer, role: str,
) -> None:
    body = {"messages": [USER, {"role": "assistant", "content": "Sure."}, {"role": role, "content": "x"}]}
    message = _refused(*await _post(tiny_tokenizer, "/v1/messages", body))
    assert "messages[2].role" in message and repr(role) in message and "'user' or 'assistant'" in message


@pytest.mark.parametrize(("messages", "where", "block", "role"), [
    ([{"role": "user", "content": [{"type": "text", "text": "Run it."}, CALL]}], "messages[0].content[1]",
     "tool_use", "user"),
    ([USER, {"role": "assistant", "content": [RESULT]}, {"role": "user", "content": "And?"}],
     "messages[1].content[0]", "tool_result", "assistant"),
    ([USER, {"role": "system", "content": [RESULT]}], "messages[1].content[0]", "tool_result", "system"),
    ([USER, {"role": "system", "content": [CALL]}], "messages[1].content[0]", "tool_use", "system"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_a_tool_block_in_the_wrong_role_is_a_400_naming_it(
    tiny_tokenizer: ModelTokenizer, path: str, messages: list[dict[str, Any]], where: str, block: str, role: str,
) -> None:
    """A tool_use in a user turn or a tool_result in an assistant turn was dropped from the
    prompt without a word (a tool_result in a system message became a tool message)."""
    message = _refused(*await _post(tiny_tokenizer, path, {"messages": messages}))
    assert where in message and block in message and repr(role) in message


async def test_a_tool_choice_naming_no_offered_tool_is_a_400_naming_it(tiny_tokenizer: ModelTokenizer) -> None:
    """As chat's and the Responses API's (Talaria refused it already; this pins the words and
    the shape). A tool call the model itself writes to an unknown name is passed on."""
    body = {"messages": [USER], "tool_choice": {"type": "tool", "name": "nope"}}
    message = _refused(*await _post(tiny_tokenizer, "/v1/messages", body))
    assert "'nope'" in message and "not in tools" in message


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
@pytest.mark.parametrize("tools", [[], None])
async def test_a_forcing_tool_choice_without_tools_is_refused_in_anthropic_words(
    tiny_tokenizer: ModelTokenizer, choice: dict[str, str], tools: list[Any] | None,
) -> None:
    """It read "tool_choice 'required' needs tools", chat's word for ``any``."""
    body = {"messages": [USER], "tool_choice": choice, "tools": tools}
    message = _refused(*await _post(tiny_tokenizer, "/v1/messages", body))
    assert message == f"tool_choice of type {choice['type']!r} needs tools"
