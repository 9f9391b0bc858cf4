"""`talaria demo` (``make demo``): a short agent session against `talaria serve` on the real
model, SmolLM2-135M-Instruct, through the `openai` client.

The agent offers a tool, sends its session in ``X-Session-ID`` on every call, runs the tool
calls the model makes and feeds their results back, and resends the whole conversation each
time, as coding agents do. Between two of its turns a second agent calls a tiny model, so the
instance switches models and back: the session's KV then comes back from host memory
(``restored``) instead of being recomputed. Per call it prints the prompt, the tokens served
from the device's prefix cache (``cached``) and from host (``restored``), and the call's time
as the client sees it: until the first streamed token (queueing, any switch, prefill) and
after it (decoding); the tool's own time is printed with its result.

The 135M model does not call tools by itself (asked with ``tool_choice: auto`` it answers in
prose), so the agent then asks again naming the tool (``tool_choice`` a function): the router
writes the call's opening and the model completes its arguments. It fills them with a copy of
the tool's JSON schema rather than a city, so the tool answers with an error, which goes back
to the model as agents send it. The tool is a local function with canned answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from talaria.real_model import CATALOG_NAME, missing_reason, packaged_gguf

__all__ = ["run_agent_demo"]

SESSION = "demo-agent-1"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
WEATHER = {"paris": "light rain, 14 C", "london": "sunny, 19 C"}
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@dataclass(frozen=True)
class Turn:
    user: str | None  # a new user message, or None: the model goes on (after a tool result)
    tool_choice: Any
    keep: bool = True  # False: the answer is shown, dropped, and the next turn retries


TURNS = [
    Turn("What is the weather in Paris right now?", "auto", keep=False),
    Turn(None, FORCED),  # the agent retries, naming the tool
    Turn(None, "auto"),
    Turn("Should I take an umbrella?", "auto"),
    Turn("And what is the weather in London?", FORCED),
    Turn(None, "auto"),
]
SWITCH_AFTER = 3  # another agent calls a tiny model after this call


@dataclass
class CallReport:
    text: str
    tool_calls: list[dict[str, Any]]
    usage: Any
    first_token_s: float
    total_s: float


def get_weather(arguments: dict[str, Any]) -> str:
    """The demo's tool: canned weather for a few cities; arguments of another shape get an
    error naming the shape it takes, as a real tool's validation would."""
    city = arguments.get("city")
    if not isinstance(city, str):
        return json.dumps({"error": 'expected arguments {"city": <name>}, got '
                                    + json.dumps(arguments)})
    weather = WEATHER.get(city.strip().lower())
    return json.dumps({"city": city, "weather": weather} if weather else
                      {"error": f"no weather for {city}"})


def _call(client: Any, messages: list[dict[str, Any]], tool_choice: Any, max_tokens: int,
          model: str = CATALOG_NAME, session: str = SESSION) -> CallReport:
    start = time.perf_counter()
    first: float | None = None
    text, calls, usage, finish = "", [], None, None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS if model == CATALOG_NAME else None,
        tool_choice=tool_choice if model == CATALOG_NAME else None, temperature=0.0,
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Session-ID": session})
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        if first is None and (delta.content or delta.tool_calls):
            first = time.perf_counter() - start
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id:
                calls.append({"id": tc.id, "type": "function",
                              "function": {"name": tc.function.name, "arguments": ""}})
            calls[-1]["function"]["arguments"] += tc.function.arguments or ""
    total = time.perf_counter() - start
    if finish != "tool_calls":
        calls = []  # a call cut short by max_tokens streams its arguments unfinished: not run, as agents do
    return CallReport(text, calls, usage, first if first is not None else total, total)


def _print_call(n: int, tool_choice: Any, r: CallReport) -> None:
    u = r.usage
    details = getattr(u, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", 0) or 0
    restored = getattr(details, "restored_tokens", 0) or 0
    choice = tool_choice if isinstance(tool_choice, str) else tool_choice["function"]["name"]
    print(f"call {n} (tool_choice={choice}): prompt {u.prompt_tokens} tok, {cached} cached, "
          f"{restored} restored | first token {r.first_token_s:.2f} s, then "
          f"{r.total_s - r.first_token_s:.2f} s for {u.completion_tokens} tok")
    if r.text:
        print(f"  answer: {r.text.strip()!r}")
    for tc in r.tool_calls:
        print(f"  tool call: {tc['function']['name']}({tc['function']['arguments']})")


def agent_session(client: Any, max_tokens: int = 128) -> list[CallReport]:
    """The agent loop of the module docstring, printing each call; returns the calls'
    reports (the session's, in order)."""
    messages: list[dict[str, Any]] = []
    reports: list[CallReport] = []
    for n, turn in enumerate(TURNS, start=1):
        if turn.user is not None:
            messages.append({"role": "user", "content": turn.user})
            print(f"user: {turn.user}")
        report = _call(client, messages, turn.tool_choice, max_tokens)
        reports.append(report)
        _print_call(n, turn.tool_choice, report)
        if not turn.keep:
            print("  (no tool call: the agent drops this answer and asks again, naming the tool)")
            continue
        messages.append({"role": "assistant", "content": report.text or None,
                         **({"tool_calls": report.tool_calls} if report.tool_calls else {})})
        for tc in report.tool_calls:
            start = time.perf_counter()
            result = get_weather(json.loads(tc["function"]["arguments"]))
            print(f"  tool result ({time.perf_counter() - start:.3f} s): {result}")
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
        if n == SWITCH_AFTER:
            other = _call(client, [{"role": "user", "content": "Fix the bug"}], None, 4,
                          model="tiny-qwen3", session="demo-other-agent")
            print(f"(another agent's call on tiny-qwen3: {other.total_s:.2f} s; the instance "
                  "switched models for it)")
    return reports


def start_serve(log: Any, timeout_s: float = 600.0) -> tuple[subprocess.Popen[str], str]:
    """`talaria serve` (default catalog) on a free port, its log to ``log``; returns the
    process and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "talaria.cli", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if line.startswith("ROUTER_READY "):
            return proc, line.split()[1]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"talaria serve did not start; its log: {log.name}")


def run_agent_demo(url: str | None = None, max_tokens: int = 128) -> int:
    """Start `talaria serve` (unless ``url`` names a running one), run the session, stop."""
    try:
        from openai import APIConnectionError, OpenAI
    except ImportError:
        print("talaria demo needs the openai package (pip install -e .[dev])", file=sys.stderr)
        return 1
    if url is None and packaged_gguf() is None:
        print(f"talaria demo: {missing_reason()}", file=sys.stderr)
        return 1
    proc = None
    if url is None:
        start = time.perf_counter()
        log = tempfile.NamedTemporaryFile("w", prefix="talaria-demo-", suffix=".log",
                                          delete=False)
        proc, url = start_serve(log)
        print(f"talaria serve (default catalog; log: {log.name}) ready at {url} in "
              f"{time.perf_counter() - start:.1f} s")
    try:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        try:
            agent_session(client, max_tokens)
        except APIConnectionError as exc:  # the CLI's one-line error, not a traceback
            raise ConnectionError(f"cannot reach the router at {url}: {exc}") from exc
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    return 0
