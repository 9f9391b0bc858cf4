"""Fault tolerance of a live `talaria serve` with two instances: one instance process is
killed (SIGKILL, not restarted: `restart = false`) while agent sessions run; every session
completes every call on the other instance, whose state then holds those sessions' KV
(rebuilt there); none is lost."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import orjson
import pytest
from serve_process import launch_serve, pid_alive, start_serve

pytestmark = pytest.mark.slow

CONFIG = """
[router]
policy = "talaria"
poll_interval_s = 0.2
instance_key = "test-instance-key-0123456789"

[[instances]]
id = "a"
kv_blocks = 256
drain_timeout_s = 2.0
restart = false

[[instances]]
id = "b"
kv_blocks = 256
drain_timeout_s = 2.0
restart = false

[policy]
slot_quantum_s = 1.0
"""
SESSIONS = 6
CALLS = 4
MAX = 16
RETRYABLE = (openai.APIConnectionError, openai.InternalServerError, openai.APITimeoutError)


def state(url: str) -> dict:
    request = urllib.request.Request(
        f"{url}/internal/v1/state",
        headers={"Authorization": "Bearer test-instance-key-0123456789"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return orjson.loads(r.read())


def test_sessions_survive_an_instance_killed_mid_run(serve_cache: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    serve = start_serve(serve_cache, config)
    pids = serve.descendants()
    client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=60)
    done_calls = [0] * SESSIONS
    retries = [0] * SESSIONS
    half_way = threading.Barrier(SESSIONS + 1, timeout=120)

    def agent(i: int) -> list[int]:
        model = ("tiny-llama", "tiny-qwen3")[i % 2]
        messages = [{"role": "user", "content": f"Session {i}: fix bug #{i * 7}"}]
        completions = []
        for turn in range(CALLS):
            if turn == 2:
                half_way.wait()  # the kill comes while calls 3..4 are being sent
            for _attempt in range(4):
                try:
                    chat = client.chat.completions.create(
                        model=model, messages=messages, max_tokens=MAX, temperature=0.0,
                        extra_headers={"X-Session-ID": f"agent-{i}"},
                        extra_body={"ignore_eos": True},
                    )
                    break
                except RETRYABLE:  # the call died with its instance: the agent re-sends it
                    retries[i] += 1
                    time.sleep(0.2)
            else:
                raise AssertionError(f"session {i} call {turn} failed 4 times")
            assert chat.usage is not None and chat.choices[0].finish_reason == "length"
            completions.append(chat.usage.completion_tokens)
            done_calls[i] += 1
            messages += [
                {"role": "assistant", "content": chat.choices[0].message.content or ""},
                {"role": "user", "content": f"tool output {turn}: ok"},
            ]
        return completions

    try:
        with ThreadPoolExecutor(SESSIONS) as pool:
            futures = [pool.submit(agent, i) for i in range(SESSIONS)]
            half_way.wait()
            held = {iid: set(state(url)["sessions"]) for iid, (_, url) in serve.instances.items()}
            victim = max(held, key=lambda iid: len(held[iid]))
            survivor = next(iid for iid in held if iid != victim)
            moved = held[victim] - held[survivor]
            assert moved, f"the victim holds no session of its own: {held}"
            os.kill(serve.instances[victim][0], signal.SIGKILL)
            results = [f.result(timeout=180) for f in futures]
        assert results == [[MAX] * CALLS] * SESSIONS  # every call of every session completed
        assert done_calls == [CALLS] * SESSIONS
        assert sum(retries) <= SESSIONS, retries  # at most the calls in flight at the kill
        after = state(serve.instances[survivor][1])
        assert moved <= set(after["sessions"]), (moved, after["sessions"])
        for sid in moved:  # their KV was rebuilt on the survivor
            kv = after["sessions"][sid]
            assert kv["device_tokens"] + kv["host_tokens"] > 0, kv
        with urllib.request.urlopen(serve.url.removesuffix("/v1") + "/health", timeout=10) as r:
            health = orjson.loads(r.read())
        assert health["healthy_instances"] == [survivor]
    finally:
        code = serve.stop(sig=signal.SIGTERM)
    assert code == 0, serve.log()
    left = [pid for pid in pids if pid_alive(pid)]
    assert not left, f"processes left behind: {left}"


def test_an_instance_that_cannot_start_stops_serve_with_a_clear_error(
    serve_cache: Path, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "clash.toml"
        config.write_text(f'[[instances]]\nid = "x"\nport = {port}\nkv_blocks = 16\n')
        serve = launch_serve(serve_cache, config)
        try:
            code = serve.proc.wait(timeout=120)
        finally:
            serve.stop(5)
    assert code == 1
    log = serve.log()
    assert "instance x exited with code 2 while starting" in log, log
    assert f"cannot listen on 127.0.0.1:{port}" in log, log
    assert not any(line.startswith("ROUTER_READY") for line in serve.stdout_lines)


def test_a_missing_model_is_refused_before_anything_starts(
    serve_cache: Path, tmp_path: Path
) -> None:
    config = tmp_path / "broken.toml"
    config.write_text('[models.broken]\npath = "no/such/model"\n')
    serve = launch_serve(serve_cache, config)
    code = serve.proc.wait(timeout=60)
    serve.stop(5)
    assert code == 2
    assert "model 'broken': no config.json" in serve.log()
