"""Anthropic's built-in client tools, offered to the model as function tools.

Anthropic's API takes some tools by ``type`` and ``name`` alone, with no ``input_schema``:
their schema is built into Claude and the client runs them (the bash, text editor and
computer use tools). An open model knows none of them, so each type known here becomes a
function tool of its documented name, a short description and a JSON schema of its
documented input; the model's call comes back as a ``tool_use`` block of that name, as a
custom tool's does. A known type under any other name is a 400 naming both (the type fixes
the name). ``max_characters`` (the 2025-07-28 editor) is accepted and not used: the client
truncates what ``view`` shows. A computer tool's display size and number go into its
description, so the model knows the screen its coordinates address.

Any other type with no ``input_schema`` is a 400 naming it: Anthropic's server tools
(``web_search_*``, ``web_fetch_*``, ``code_execution_*``, ...), which Anthropic runs on its own
servers and this router cannot, and types not known here.

Sources of the names, inputs, required fields and enums: Anthropic's tool pages
(https://platform.claude.com/docs/en/agents-and-tools/tool-use/bash-tool, ``text-editor-tool``
and ``computer-use-tool`` beside it), the anthropic SDK's tool types (``BetaToolBash20241022``,
``BetaToolTextEditor20250728``, ``BetaToolComputerUse20250124``, ...: the names and the tool
fields) and, for the computer's actions, Anthropic's reference implementation
(anthropics/anthropic-quickstarts, ``computer-use-demo/computer_use_demo/tools/computer.py``).
The 2025-07-28 editor's ``insert`` takes ``new_str`` as documented, which clients implement
(anthropic-sdk-python issue 1155 reports Claude itself writing ``insert_text``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from talaria.protocol.errors import bad_request

__all__ = ["BUILTIN_TOOLS", "BuiltinTool", "builtin_function"]


@dataclass(frozen=True)
class BuiltinTool:
    """One built-in client tool type: the name its client must give it, what it does (the
    model's description) and its input's JSON schema."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    screen: bool = False  # the computer tool: its display goes into the description


def _schema(properties: dict[str, Any], required: tuple[str, ...] = ()) -> Mapping[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return MappingProxyType(schema)


def _field(kind: str, description: str, **more: Any) -> dict[str, Any]:
    return {"type": kind, "description": description, **more}


_BASH = BuiltinTool(
    "bash",
    "Run a shell command in a persistent bash session: its state (environment variables, the "
    "working directory, files written) persists between commands. Returns stdout and stderr.",
    _schema({
        "command": _field("string", "The bash command to run. Required unless restart is true."),
        "restart": _field("boolean", "true restarts the bash session."),
    }),
)

_EDIT_COMMANDS = ("view", "create", "str_replace", "insert")


def _text_editor(name: str, undo: bool) -> BuiltinTool:
    commands = _EDIT_COMMANDS + (("undo_edit",) if undo else ())
    return BuiltinTool(
        name,
        "View, create and edit text files: view shows a file or lists a directory, create "
        "writes a new file, str_replace replaces an exact string that occurs "
        "once, insert adds text after a line" + (", undo_edit reverts the last edit of a file." if undo else "."),
        _schema({
            "command": _field("string", "The command to run.", enum=list(commands)),
            "path": _field("string", "Absolute path to the file or directory."),
            "file_text": _field("string", "The content of the file to create (create)."),
            "old_str": _field("string", "The exact text to replace, whitespace included (str_replace)."),
            "new_str": _field("string", "The replacement text (str_replace) or the text to insert (insert)."),
            "insert_line": _field("integer", "The line after which to insert new_str; 0 inserts at the "
                                  "start (insert)."),
            "view_range": _field("array", "[start, end] line numbers to view, from 1; end -1 views to the "
                                 "end of the file (view of a file).",
                                 items={"type": "integer"}, minItems=2, maxItems=2),
        }, ("command", "path")),
    )


_POINT = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
_COMPUTER = ("Use a mouse and keyboard to interact with a computer's screen, and take screenshots. "
             "Coordinates are (x, y) pixels from the left and top edges of the screen.")
_ACTIONS_20241022 = ("key", "type", "mouse_move", "left_click", "left_click_drag", "right_click",
                     "middle_click", "double_click", "screenshot", "cursor_position")
_ACTIONS_20250124 = _ACTIONS_20241022 + ("left_mouse_down", "left_mouse_up", "scroll", "hold_key",
                                         "wait", "triple_click")

_COMPUTER_20241022 = BuiltinTool("computer", _COMPUTER, _schema({
    "action": _field("string", "The action to perform.", enum=list(_ACTIONS_20241022)),
    "coordinate": {**_POINT, "description": "(x, y) to move the mouse to (mouse_move, left_click_drag)."},
    "text": _field("string", "The text to type (type) or the key or key combination to press in "
                   "xdotool syntax, e.g. ctrl+s (key)."),
}, ("action",)), screen=True)

_COMPUTER_20250124 = BuiltinTool("computer", _COMPUTER, _schema({
    "action": _field("string", "The action to perform.", enum=list(_ACTIONS_20250124)),
    "coordinate": {**_POINT, "description": "(x, y) to act at: where to move, click or scroll, or "
                   "where a drag ends."},
    "start_coordinate": {**_POINT, "description": "(x, y) where a drag starts (left_click_drag)."},
    "text": _field("string", "The text to type (type), the key or key combination in xdotool syntax "
                   "(key, hold_key), or keys to hold while clicking or scrolling."),
    "scroll_direction": _field("string", "The direction to scroll (scroll).",
                               enum=["up", "down", "left", "right"]),
    "scroll_amount": _field("integer", "How many clicks of the scroll wheel (scroll)."),
    "duration": _field("number", "Seconds to hold the key (hold_key) or to wait (wait)."),
}, ("action",)), screen=True)

BUILTIN_TOOLS: Mapping[str, BuiltinTool] = MappingProxyType({
    "bash_20241022": _BASH,
    "bash_20250124": _BASH,
    "text_editor_20241022": _text_editor("str_replace_editor", undo=True),
    "text_editor_20250124": _text_editor("str_replace_editor", undo=True),
    "text_editor_20250429": _text_editor("str_replace_based_edit_tool", undo=False),
    "text_editor_20250728": _text_editor("str_replace_based_edit_tool", undo=False),
    "computer_20241022": _COMPUTER_20241022,
    "computer_20250124": _COMPUTER_20250124,
})


def builtin_function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat function tool of ``tool``, a tool with a string ``name`` and no
    ``input_schema``: a built-in client tool of a known type, else a 400 naming its type."""
    kind = tool.get("type")
    known = BUILTIN_TOOLS.get(kind) if isinstance(kind, str) else None
    if known is None:
        if kind is None or kind == "custom":
            raise bad_request(f"{where} ({tool['name']!r}): a custom tool needs an input_schema object", "tools")
        raise bad_request(
            f"{where}: tools of type {kind!r} are not supported: server tools (web search, web fetch, "
            "code execution, ...) run on Anthropic's servers and are not run here. This server takes "
            "custom tools (with an input_schema) and the client tools " + ", ".join(BUILTIN_TOOLS), "tools")
    if tool["name"] != known.name:
        raise bad_request(f"{where}: a tool of type {kind!r} must be named {known.name!r}, "
                          f"not {tool['name']!r}", "tools")
    description = known.description + (_display(tool) if known.screen else "")
    return {"type": "function", "function": {"name": known.name, "description": description,
                                             "parameters": _plain(known.parameters)}}


def _display(tool: dict[str, Any]) -> str:
    """The computer tool's screen, as its client sized it (nothing where it did not)."""
    width, height, number = (tool.get(k) for k in ("display_width_px", "display_height_px", "display_number"))
    if not (_count(width) and _count(height)):
        return ""
    return f" The screen is {width}x{height} pixels" + (f" (X11 display :{number})." if _count(number) else ".")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _plain(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A request's own copy of a schema, as plain dicts (the template renders it with tojson)."""
    return copy.deepcopy(dict(schema))
