"""Claude Code's side calls between two main-loop turns, end to end: the official anthropic
client over HTTP, the router, and two instances (the admission loop over the exact fake
engine, which keeps each session's KV by the session id the instance is sent). A side call
under the main loop's session id, of its model or another, must not move the main loop nor
take its KV or its reservation: the router sends each KV chain of a session (a branch) under
its own key, and the instance keeps one record per key."""

from __future__ import annotations

from typing import Any

import anthropic
from aiohttp.test_utils import TestServer
from fake_engine import FakeEngine

from engine.models.tiny import build_tokenizer
from router.app import CORE_KEY, RouterConfig, create_app
from router.instances.inprocess import InProcessClient
from router.tokenization import ModelTokenizer
from talaria.instance.instance import Instance
from talaria.policies.config import preset

SYSTEM = "You are Claude Code, an interactive command line tool that helps users with software tasks."
HEADERS = {"x-claude-code-session-id": "cc"}


async def test_side_calls_between_main_loop_turns_leave_its_instance_and_kv() -> None:
    engines = {iid: FakeEngine(["big", "small"], initial_model=first, step_s=0.001, switch_host_s=0.01,
                               switch_staged_s=0.01, stage_s=0.01)
               for iid, first in (("a", "big"), ("b", "small"))}
    instances = {iid: Instance(iid, engine, preset("talaria")) for iid, engine in engines.items()}
    for inst in instances.values():
        await inst.start()
    tokenizer = build_tokenizer(512)
    config = RouterConfig(models={"big": "/unused", "small": "/unused"}, instances={"a": "", "b": ""},
                          poll_interval_s=None)
    app = create_app(config, {i: InProcessClient(i, inst) for i, inst in instances.items()},
                     {m: ModelTokenizer(m, tokenizer, 4096) for m in ("big", "small")})
    server = TestServer(app)
    await server.start_server()
    claude = anthropic.AsyncAnthropic(base_url=str(server.make_url("/")).rstrip("/"), api_key="unused",
                                      max_retries=0, timeout=60)

    async def ask(model: str, messages: list[dict[str, Any]]) -> Any:
        return await claude.messages.create(model=model, max_tokens=8, system=SYSTEM, messages=messages,
                                            extra_headers=HEADERS)

    def ran_on(message: Any) -> str:
        call_id = message.id.removeprefix("msg_")
        return next(i for i, e in engines.items() if ("add", call_id) in e.log)

    try:
        history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test in parser.py"}]
        turns, cached = [], []
        for turn in range(3):
            reply = await ask("big", history)
            turns.append(ran_on(reply))
            cached.append(reply.usage.cache_read_input_tokens or 0)
            history += [{"role": "assistant", "content": reply.content[0].text},
                        {"role": "user", "content": f"The test still fails ({turn})."}]
            main = turns[0]
            # Side calls as Claude Code sends them, under the same session: a title (the main
            # loop's model), a command-prefix check (another model).
            title = await ask("big", [{"role": "user", "content": f"Write a 5-word title ({turn})."}])
            check = await ask("small", [{"role": "user", "content": f"Is `pytest -x` safe? ({turn})"}])
            assert ran_on(title) == main  # where the shared system prompt's blocks are
            assert ran_on(check) != main  # the other model is active on the other instance
            state = instances[main].state()
            assert state.sessions["cc"].model == "big" and state.sessions["cc"].reserved_until is not None
            assert engines[main].pinned("cc")  # the side calls did not take its reservation
        assert turns == [main] * 3
        assert cached[0] == 0 and 0 < cached[1] < cached[2], cached
        record = app[CORE_KEY].sessions.get("cc")
        assert record is not None and record.main is not None and record.main.key == "cc"
        assert record.main.calls == 3 and record.main.instance_id == main
    finally:
        await claude.close()
        await server.close()
        for inst in instances.values():
            await inst.stop(drain=False)
