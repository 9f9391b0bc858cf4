"""Anthropic's built-in client tools (bash, text editor, computer), sent by type with no
input_schema, become function tools of their documented names and inputs; a wrong name for
a type and a server tool (web search, ...) are 400s naming them. End to end with the
official anthropic client over real HTTP, on the tiny models' tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest
from aiohttp.test_utils import TestServer
from api_helpers import EOS, serve
from router_fakes import ScriptedInstance

from router.api.anthropic_schema import parse_count_tokens, parse_messages
from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer
from talaria.protocol.errors import ApiError

USER = [{"role": "user", "content": "List the files here."}]
EDIT_COMMANDS = ["view", "create", "str_replace", "insert"]
EDITOR_FIELDS = {"command", "path", "file_text", "old_str", "new_str", "insert_line", "view_range"}
ACTIONS_2024 = ["key", "type", "mouse_move", "left_click", "left_click_drag", "right_click", "middle_click",
                "double_click", "screenshot", "cursor_position"]
ACTIONS_2025 = ACTIONS_2024 + ["left_mouse_down", "left_mouse_up", "scroll", "hold_key", "wait", "triple_click"]
COMPUTER_2025_FIELDS = {"action", "coordinate", "start_coordinate", "text", "scroll_direction", "scroll_amount",
                        "duration"}
# type -> (documented name, required input fields, input fields, the enum of its first required field)
KNOWN: dict[str, tuple[str, list[str] | None, set[str], list[str] | None]] = {
    "bash_20241022": ("bash", None, {"command", "restart"}, None),
    "bash_20250124": ("bash", None, {"command", "restart"}, None),
    "text_editor_20241022": ("str_replace_editor", ["command", "path"], EDITOR_FIELDS, EDIT_COMMANDS + ["undo_edit"]),
    "text_editor_20250124": ("str_replace_editor", ["command", "path"], EDITOR_FIELDS, EDIT_COMMANDS + ["undo_edit"]),
    "text_editor_20250429": ("str_replace_based_edit_tool", ["command", "path"], EDITOR_FIELDS, EDIT_COMMANDS),
    "text_editor_20250728": ("str_replace_based_edit_tool", ["command", "path"], EDITOR_FIELDS, EDIT_COMMANDS),
    "computer_20241022": ("computer", ["action"], {"action", "coordinate", "text"}, ACTIONS_2024),
    "computer_20250124": ("computer", ["action"], COMPUTER_2025_FIELDS, ACTIONS_2025),
}


def offered(*tools: dict[str, Any]) -> list[dict[str, Any]]:
    body = parse_messages({"model": "tiny", "max_tokens": 16, "messages": USER, "tools": list(tools)}).body
    return body.tools.tools or []


def refusal(tools: list[dict[str, Any]]) -> str:
    with pytest.raises(ApiError) as caught:
        parse_messages({"model": "tiny", "max_tokens": 16, "messages": USER, "tools": tools})
    assert caught.value.status == 400
    return caught.value.message


@pytest.mark.parametrize("kind", list(KNOWN))
def test_each_known_type_becomes_a_function_of_its_documented_name_and_input(kind: str) -> None:
    name, required, fields, enum = KNOWN[kind]
    tool = {"type": kind, "name": name, "cache_control": {"type": "ephemeral"}}
    if kind.startswith("computer"):
        tool.update(display_width_px=1280, display_height_px=800)
    if kind == "text_editor_20250728":
        tool["max_characters"] = 10000
    [function_tool] = offered(tool)
    assert function_tool["type"] == "function"
    function = function_tool["function"]
    assert function["name"] == name and function["description"]
    params = function["parameters"]
    assert params["type"] == "object" and set(params["properties"]) == fields
    assert params.get("required") == required
    if enum is not None:
        assert params["properties"][required[0]]["enum"] == enum  # type: ignore[index]
    if kind.startswith("text_editor"):
        assert params["properties"]["insert_line"]["type"] == "integer"
        view_range = params["properties"]["view_range"]
        assert (view_range["type"], view_range["items"], view_range["minItems"], view_range["maxItems"]) == (
            "array", {"type": "integer"}, 2, 2)
    if kind.startswith("computer"):
        assert "1280x800 pixels" in function["description"]
    else:
        assert set(params["properties"]) <= {"command", "restart"} | EDITOR_FIELDS


def test_each_request_gets_its_own_schema_and_custom_tools_keep_working() -> None:
    first = offered({"type": "bash_20250124", "name": "bash"})
    first[0]["function"]["parameters"]["properties"]["command"]["type"] = "changed"
    again = offered({"type": "bash_20250124", "name": "bash"},
                    {"type": "custom", "name": "lookup", "input_schema": {"type": "object"}},
                    {"name": "plain", "description": "d", "input_schema": {"type": "object"}})
    assert again[0]["function"]["parameters"]["properties"]["command"]["type"] == "string"
    assert again[1:] == [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
                         {"type": "function", "function": {"name": "plain", "parameters": {"type": "object"},
                                                           "description": "d"}}]


@pytest.mark.parametrize(("kind", "name", "documented"), [
    ("bash_20250124", "shell", "bash"),
    ("text_editor_20250728", "str_replace_editor", "str_replace_based_edit_tool"),
    ("text_editor_20250124", "str_replace_based_edit_tool", "str_replace_editor"),
    ("computer_20241022", "mouse", "computer"),
])
def test_a_known_type_under_another_name_is_a_400_naming_both(kind: str, name: str, documented: str) -> None:
    message = refusal([{"type": kind, "name": name}])
    assert f"must be named {documented!r}, not {name!r}" in message and kind in message


@pytest.mark.parametrize("kind", ["web_search_20250305", "web_fetch_20250910", "code_execution_20250825",
                                  "bash_20990101"])
def test_a_server_or_unknown_tool_type_is_a_400_naming_it(kind: str) -> None:
    tools = [{"type": "bash_20250124", "name": "bash"}, {"type": kind, "name": "x", "max_uses": 5}]
    message = refusal(tools)
    assert message.startswith(f"tools[1]: tools of type {kind!r} are not supported")
    assert "not run here" in message and "bash_20250124" in message
    with pytest.raises(ApiError, match="not run here"):
        parse_count_tokens({"model": "tiny", "messages": USER, "tools": tools})


def test_a_custom_tool_without_an_input_schema_is_a_400_that_says_so() -> None:
    assert "a custom tool needs an input_schema object" in refusal([{"name": "lookup"}])
    assert "a custom tool needs an input_schema object" in refusal([{"type": "custom", "name": "lookup"}])
    assert "input_schema must be an object" in refusal([{"name": "lookup", "input_schema": []}])


async def test_a_server_tool_over_http_is_an_anthropic_400(tiny_tokenizer: ModelTokenizer) -> None:
    instance = ScriptedInstance("i0", [[EOS]])
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 8}]
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        for path, body in (("/v1/messages", {"max_tokens": 16}), ("/v1/messages/count_tokens", {})):
            resp = await client.post(path, json={"model": "tiny", "messages": USER, "tools": tools, **body})
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error" and "'web_search_20250305'" in error["message"]
    assert instance.calls == []


async def test_the_sdk_s_bash_tool_is_offered_called_and_answered(
        tiny_tokenizer: ModelTokenizer, tiny_model_dir: Path) -> None:
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    script = [call, call, "Two files."]
    instance = ScriptedInstance("i0", [tiny_tokenizer.encode_text(t, add_special_tokens=False) + [EOS]
                                       for t in script])
    config = RouterConfig(models={"tiny": str(tiny_model_dir)}, instances={"i0": "unused"}, poll_interval_s=None)
    server = TestServer(create_app(config, clients={"i0": instance}, tokenizers={"tiny": tiny_tokenizer}))
    await server.start_server()
    client = anthropic.AsyncAnthropic(base_url=str(server.make_url("/")), api_key="unused", max_retries=0)
    decode = tiny_tokenizer.tokenizer.decode
    try:
        tools: list[Any] = [{"type": "bash_20250124", "name": "bash"}]
        used = await client.messages.create(model="tiny", max_tokens=200, messages=USER, tools=tools)
        prompt = decode(instance.calls[0].prompt_token_ids)
        assert '{"type": "function", "function": {"name": "bash", "description": "Run a shell command' in prompt
        assert '"command": {"type": "string"' in prompt and '"restart": {"type": "boolean"' in prompt
        assert used.stop_reason == "tool_use" and [b.type for b in used.content] == ["tool_use"]
        assert used.content[0].name == "bash" and used.content[0].input == {"command": "ls -la"}

        async with client.messages.stream(model="tiny", max_tokens=200, messages=USER, tools=tools) as stream:
            streamed = await stream.get_final_message()
        assert streamed.content[0].name == "bash" and streamed.content[0].input == {"command": "ls -la"}

        history = USER + [
            {"role": "assistant", "content": [b.model_dump() for b in used.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": used.content[0].id,
                                          "content": "a.py\nb.py"}]},
        ]
        done = await client.messages.create(model="tiny", max_tokens=64, messages=history, tools=tools)
        assert done.content[0].text == "Two files." and done.stop_reason == "end_turn"
        assert "a.py\nb.py" in decode(instance.calls[2].prompt_token_ids)
    finally:
        await client.close()
        await server.close()
