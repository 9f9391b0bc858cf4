"""The real Claude Code and Codex CLIs through a whole tool loop against the router.

Each CLI runs non-interactively (``claude -p``, ``codex exec``) against the router's app,
served in-process on a free localhost port over a scripted instance on the tiny models'
tokenizer and chat template (a 200000-token context: the CLIs' own prompts are 23k-50k
tokens). The instance reads each call's prompt to choose its answer (the CLIs also send side
calls, whose order is not fixed): the CLI's task without a tool result gets a shell tool call
(Claude Code's ``Bash``, Codex's ``exec_command``) whose arguments run past the 64 characters
a stream holds them to, so they go out as several ``input_json_delta`` /
``response.function_call_arguments.delta`` pieces; its first token waits 2 s, past the
router's ``stream_commit_s`` (0.5 s), so the stream commits early and sends keep-alives
(``stream_keepalive_s`` 0.3 s: Anthropic ``ping`` events, repeated ``response.in_progress``).
A prompt holding the tool's result gets plain text. Checked: the CLI exits 0, it ran the
command (the proof file holds ``talaria-ok``), its next call carried the command's output as
a tool result, it printed the final text, and what went over the wire was what was meant to
be checked (several argument pieces, keep-alives before the first token). The ``thinking``
runs have the model think first (a ``qwen3`` reasoning parser): Claude Code gets a thinking
block (it asks for ``thinking: adaptive``) and sends it back, Codex a reasoning item. And a
call refused as overloaded after its stream committed (an in-stream error, not a 429) is
retried by both CLIs, which then finish the loop.

Each test is skipped unless its CLI (``claude``, ``codex``) is found: in the folder
``TALARIA_AGENT_CLI_BIN`` names, else on ``PATH`` (CI has neither). Run it with ``make agent-check``
(installs both from npm into a scratch prefix), or by hand::

    npm install --prefix /tmp/agentcli @anthropic-ai/claude-code @openai/codex
    TALARIA_AGENT_CLI_BIN=/tmp/agentcli/node_modules/.bin \\
        .venv/bin/python -m pytest -q -p no:cacheprovider tests/router/api/test_agent_cli.py
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from api_helpers import EOS, sse_blocks
from router_fakes import ScriptedInstance, write_tiny_tokenizer

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest, Overloaded

pytestmark = pytest.mark.slow

CONTEXT = 200_000
MODEL = "tiny"
TASK = "Write the word talaria-ok into the file proof.txt in the working directory, then say so."
FIRST_TOKEN_DELAY_S = 2.0
COMMIT_S = 0.5
KEEPALIVE_S = 0.3
CLI_TIMEOUT_S = 240.0
RETRY_AFTER_S = 3.0
FINAL = "All done: the proof file holds talaria-ok."
SIDE = "Proof file"  # any call that is neither the task nor its follow-up (titles, summaries)
THINKING = "The user wants a file written; one shell command does it.\n"
THOUGHT = f"<think>\n{THINKING}</think>\n\n"  # what a thinking model writes before its answer


def cli_bin(name: str) -> str | None:
    folder = os.environ.get("TALARIA_AGENT_CLI_BIN")
    if folder:
        path = Path(folder) / name
        return str(path) if os.access(path, os.X_OK) else None
    return shutil.which(name)


CLAUDE, CODEX = cli_bin("claude"), cli_bin("codex")


@dataclass
class Answered:
    prompt: str
    kind: str  # "call", "final" or "side" ("overloaded": refused)
    at: float = field(default_factory=time.monotonic)  # when the call came


class AgentInstance(ScriptedInstance):
    """Answers by reading the prompt, not by arrival order: the task with no tool result yet
    gets ``call_text`` (its first token ``FIRST_TOKEN_DELAY_S`` late), a prompt with a tool result gets
    ``FINAL``, anything else ``SIDE``."""

    def __init__(self, tok: ModelTokenizer, tool: str, call_text: str, thinking: bool) -> None:
        super().__init__("i0", [])
        self.tok = tok
        self.tool = tool
        self.call_text = call_text
        self.thinking = thinking
        self.answered: list[Answered] = []

    def choose(self, prompt: str) -> tuple[str, str]:
        if TASK not in prompt or f'"name": "{self.tool}"' not in prompt:
            return "side", SIDE
        if "<tool_response>" in prompt:
            return "final", FINAL
        return "call", self.call_text

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        prompt = self.tok.tokenizer.decode(call.prompt_token_ids)
        kind, text = self.choose(prompt)
        self.answered.append(Answered(prompt, kind))
        if self.thinking and kind != "side":
            text = THOUGHT + text
        tokens = self.tok.encode_text(text, add_special_tokens=False) + [EOS]
        if kind == "call":
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        for i, token in enumerate(tokens):
            await asyncio.sleep(0)
            last = i == len(tokens) - 1
            yield CallEvent(call_id=call.call_id, token_ids=[token], finished=last,
                            finish_reason="stop" if last else None, usage=self.usage(call, i, len(tokens)))


@dataclass
class Wire:
    """What the router wrote on each streamed response, and each request's path and body."""

    streams: list[tuple[web.StreamResponse, list[bytes]]] = field(default_factory=list)
    requests: list[tuple[str, Any]] = field(default_factory=list)

    def wrote(self, response: web.StreamResponse, data: bytes) -> None:
        chunks = next((c for r, c in self.streams if r is response), None)
        if chunks is None:
            chunks = []
            self.streams.append((response, chunks))
        chunks.append(bytes(data))

    def events(self) -> list[list[tuple[str | None, Any]]]:
        return [sse_blocks(b"".join(chunks).decode()) for _, chunks in self.streams]

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Iterator[Wire]:
    recorded = Wire()
    write = web.StreamResponse.write

    async def recording(self: web.StreamResponse, data: bytes) -> None:
        if self.content_type == "text/event-stream":
            recorded.wrote(self, data)
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", recording)
    yield recorded


@pytest.fixture(scope="module")
def long_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    """The tiny models' tokenizer and template with a context that holds an agent's prompt."""
    return ModelTokenizer.load(MODEL, write_tiny_tokenizer(tmp_path_factory.mktemp("agent-model"), CONTEXT))


async def _serve(tok: ModelTokenizer, instance: AgentInstance, wire: Wire, thinking: bool) -> TestServer:
    config = RouterConfig(models={MODEL: "/unused"}, instances={"i0": "unused"}, poll_interval_s=None,
                          stream_commit_s=COMMIT_S, stream_keepalive_s=KEEPALIVE_S,
                          reasoning_parsers={MODEL: "qwen3"} if thinking else {})
    app = create_app(config, clients={"i0": instance}, tokenizers={MODEL: tok})

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        wire.requests.append((request.path, json.loads(raw) if raw else None))
        return await handler(request)

    app.middlewares.insert(0, record)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        pytest.fail(f"{cmd[0]} did not finish in {CLI_TIMEOUT_S} s\nstdout:\n{out.decode()}\nstderr:\n{err.decode()}")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "NO_COLOR": "1", "TERM": "dumb"}


def _tool_results(prompt: str) -> list[str]:
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, flags=re.S)


def _check_loop(instance: AgentInstance, proof: Path, rc: int, out: str, err: str) -> None:
    report = f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}\nanswered: {[a.kind for a in instance.answered]}"
    assert rc == 0, report
    assert proof.is_file() and proof.read_text().strip() == "talaria-ok", report
    kinds = [a.kind for a in instance.answered]
    assert "call" in kinds and "final" in kinds, report
    final = next(a for a in instance.answered if a.kind == "final")
    assert any("talaria-ok" in r for r in _tool_results(final.prompt)), final.prompt[-2000:]
    assert FINAL in out, report


def _blocks(messages: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The content blocks of type ``kind`` in Anthropic ``messages``."""
    return [b for m in messages if isinstance(m["content"], list) for b in m["content"] if b.get("type") == kind]


def _argument_pieces(events: list[tuple[str | None, Any]]) -> list[str]:
    """A stream's tool-call argument pieces, in either API's events."""
    return [d["delta"]["partial_json"] if name == "content_block_delta" else d["delta"] for name, d in events
            if (name == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
            or name == "response.function_call_arguments.delta"]


def _streamed(wire: Wire, keep_alive: str, first_content: str) -> list[tuple[str | None, Any]]:
    """The events of the stream that carried the tool call, checked to hold keep-alives before
    its first content (the early commit)."""
    calls = [events for events in wire.events() if _argument_pieces(events)]
    assert len(calls) == 1, [[name for name, _ in e] for e in wire.events()]
    names = [name for name, _ in calls[0]]
    assert names[: names.index(first_content)].count(keep_alive) >= 3, names
    return calls[0]


def _claude_case(work: Path) -> tuple[Path, dict[str, Any], str]:
    """The proof file, the Bash call's arguments and the text of the model's call."""
    proof = work / "proof.txt"
    arguments = {"command": f"echo talaria-ok > {proof} && cat {proof}",
                 "description": "Write talaria-ok into the proof file and show it"}
    return proof, arguments, "I will write the file.\n<tool_call>\n" + json.dumps(
        {"name": "Bash", "arguments": arguments}) + "\n</tool_call>"


def _codex_case(work: Path) -> tuple[Path, dict[str, Any], str]:
    proof = work / "proof.txt"
    arguments = {"cmd": f"echo talaria-ok > {proof} && cat {proof}"}
    return proof, arguments, "I will write the file.\n<tool_call>\n" + json.dumps(
        {"name": "exec_command", "arguments": arguments}) + "\n</tool_call>"


async def _run_claude(server: TestServer, work: Path, home: Path) -> tuple[int, str, str]:
    assert CLAUDE is not None
    home.mkdir(exist_ok=True)
    env = _base_env(home) | {
        "ANTHROPIC_BASE_URL": str(server.make_url("/")).rstrip("/"), "ANTHROPIC_AUTH_TOKEN": "unused",
        "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1"}
    return await _run([CLAUDE, "-p", TASK, "--allowedTools", "Bash", "--max-turns", "4"], work, env)


async def _run_codex(server: TestServer, work: Path, home: Path) -> tuple[int, str, str]:
    assert CODEX is not None
    codex_home = home / "codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "talaria"\n\n[model_providers.talaria]\nname = "Talaria"\n'
        f'base_url = "{str(server.make_url("/v1")).rstrip("/")}"\nenv_key = "TALARIA_API_KEY"\n'
        'wire_api = "responses"\n')
    env = _base_env(home) | {"CODEX_HOME": str(codex_home), "TALARIA_API_KEY": "unused"}
    return await _run([CODEX, "exec", "--skip-git-repo-check", "--ephemeral",
                       "--dangerously-bypass-approvals-and-sandbox", "--color", "never", TASK], work, env)


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    work = tmp_path / "work"
    work.mkdir()
    return work, tmp_path / "home"


CASES = {"claude": ("Bash", _claude_case, _run_claude), "codex": ("exec_command", _codex_case, _run_codex)}


async def _tool_loop(tok: ModelTokenizer, wire: Wire, tmp_path: Path, cli: str, thinking: bool,
                     instance_type: type[AgentInstance] = AgentInstance) -> tuple[AgentInstance, dict[str, Any]]:
    """Serve an ``instance_type`` scripted for ``cli``'s shell tool, run the CLI through its
    tool loop and check the loop (``_check_loop``); the instance and the call's arguments."""
    work, home = _dirs(tmp_path)
    tool, case, run = CASES[cli]
    proof, arguments, call_text = case(work)
    instance = instance_type(tok, tool, call_text, thinking)
    server = await _serve(tok, instance, wire, thinking)
    try:
        rc, out, err = await run(server, work, home)
    finally:
        await server.close()
    _check_loop(instance, proof, rc, out, err)
    return instance, arguments


@pytest.mark.skipif(CLAUDE is None, reason="no claude CLI (TALARIA_AGENT_CLI_BIN or PATH)")
@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "thinking"])
async def test_claude_code_tool_loop(long_tokenizer: ModelTokenizer, wire: Wire, tmp_path: Path,
                                     thinking: bool) -> None:
    _instance, arguments = await _tool_loop(long_tokenizer, wire, tmp_path, "claude", thinking)
    events = _streamed(wire, "ping", "content_block_start")
    pieces = _argument_pieces(events)
    assert len(pieces) >= 2 and json.loads("".join(pieces)) == arguments, pieces
    blocks = [d["content_block"]["type"] for name, d in events if name == "content_block_start"]
    assert blocks == (["thinking"] if thinking else []) + ["text", "tool_use"], blocks
    assert events[-1][0] == "message_stop"
    assert [d["delta"]["stop_reason"] for name, d in events if name == "message_delta"] == ["tool_use"]
    # The call and its result went back as Anthropic blocks (the thinking block too).
    (history,) = [b["messages"] for b in wire.bodies("/v1/messages") if _blocks(b["messages"], "tool_result")]
    (used,) = _blocks(history, "tool_use")
    (result,) = _blocks(history, "tool_result")
    assert used["input"] == arguments and result["tool_use_id"] == used["id"], history[-2:]
    assert "talaria-ok" in json.dumps(result["content"]) and not result.get("is_error"), result
    assert [b["thinking"] for b in _blocks(history, "thinking")] == ([THINKING] if thinking else [])


@pytest.mark.skipif(CODEX is None, reason="no codex CLI (TALARIA_AGENT_CLI_BIN or PATH)")
@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "thinking"])
async def test_codex_tool_loop(long_tokenizer: ModelTokenizer, wire: Wire, tmp_path: Path, thinking: bool) -> None:
    _instance, arguments = await _tool_loop(long_tokenizer, wire, tmp_path, "codex", thinking)
    events = _streamed(wire, "response.in_progress", "response.output_item.added")
    pieces = _argument_pieces(events)
    assert len(pieces) >= 2 and json.loads("".join(pieces)) == arguments, pieces
    items = [d["item"]["type"] for name, d in events if name == "response.output_item.added"]
    assert items == (["reasoning"] if thinking else []) + ["message", "function_call"], items
    assert events[-1][0] == "response.completed"
    # The call and its output went back as Responses items (the reasoning item too).
    (history,) = [b["input"] for b in wire.bodies("/v1/responses")
                  if any(i.get("type") == "function_call_output" for i in b["input"])]
    (used,) = [i for i in history if i.get("type") == "function_call"]
    (output,) = [i for i in history if i.get("type") == "function_call_output"]
    assert json.loads(used["arguments"]) == arguments and output["call_id"] == used["call_id"], history[-3:]
    assert "talaria-ok" in json.dumps(output["output"]), output
    reasoning = [part["text"] for i in history if i.get("type") == "reasoning" for part in i.get("content") or []]
    assert reasoning == ([THINKING] if thinking else []), history[-4:]


class OverloadedOnce(AgentInstance):
    """Refuses the first call it would answer with the tool call as overloaded, after its
    stream committed (``FIRST_TOKEN_DELAY_S`` after it came): a full queue found late."""

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        prompt = self.tok.tokenizer.decode(call.prompt_token_ids)
        if self.choose(prompt)[0] == "call" and not any(a.kind == "overloaded" for a in self.answered):
            self.calls.append(call)
            self.answered.append(Answered(prompt, "overloaded"))
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            raise Overloaded("i0: the queue is full", retry_after_s=RETRY_AFTER_S)
        async for event in super().submit(call):
            yield event


@pytest.mark.parametrize("cli", [
    pytest.param("claude", marks=pytest.mark.skipif(CLAUDE is None, reason="no claude CLI")),
    pytest.param("codex", marks=pytest.mark.skipif(CODEX is None, reason="no codex CLI"))])
async def test_overload_after_commit_is_retried(long_tokenizer: ModelTokenizer, wire: Wire, tmp_path: Path,
                                                cli: str) -> None:
    """A call refused after its stream committed ends in the API's error event (no HTTP 429
    can be sent then); both CLIs retry it and finish the loop. Codex waits the delay the
    message gives (``Please try again in 3s.``); Claude Code its own backoff (the event has
    no ``Retry-After``), so only Codex's wait is checked."""
    instance, _arguments = await _tool_loop(long_tokenizer, wire, tmp_path, cli, False, OverloadedOnce)
    kinds = [a.kind for a in instance.answered]
    assert kinds[kinds.index("overloaded") + 1] == "call", kinds
    refused = next(events for events in wire.events() if not _argument_pieces(events))
    names = [name for name, _ in refused]
    if cli == "claude":
        assert names[-1] == "error" and refused[-1][1]["error"]["type"] == "overloaded_error", names
    else:
        assert names[-2:] == ["error", "response.failed"], names
        assert refused[-2][1]["code"] == "rate_limit_exceeded"
        assert refused[-2][1]["message"].endswith(f"Please try again in {RETRY_AFTER_S:.0f}s.")
        ats = [a.at for a in instance.answered]
        retried = ats[kinds.index("overloaded") + 1] - ats[kinds.index("overloaded")] - FIRST_TOKEN_DELAY_S
        assert retried >= RETRY_AFTER_S - 0.5, retried
