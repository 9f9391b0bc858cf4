"""Chaos: a live replay of agent sessions against `talaria serve` (two instances, tiny CPU
models) while one instance hangs for a while (SIGSTOP, then SIGCONT: its calls miss their
first-token and stall deadlines, its polls time out) and instance processes are killed twice
(SIGKILL). The supervisor restarts each killed instance, the router re-adds it, and the
replay client re-sends a failed call as an agent would; every session completes every call,
and the client reports how many re-sends it needed."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from serve_process import ServeProcess, pid_alive, start_serve

from talaria.clock import run_live
from workloads.replay.live import live_replay
from workloads.traces.generator import default_trace

pytestmark = pytest.mark.slow

CONFIG = """
[router]
poll_interval_s = 0.2
first_token_timeout_s = 2.0
stall_timeout_s = 2.0

[[instances]]
id = "a"
kv_blocks = 256
drain_timeout_s = 1.0

[[instances]]
id = "b"
kv_blocks = 256
drain_timeout_s = 1.0

[policy]
slot_quantum_s = 0.5
"""
SESSIONS = 12
CALLS = 16
OUTPUT_TOKENS = 2400  # x token_scale 0.02: 48 tokens, so a kill finds calls mid-stream


def instance_pids(serve: ServeProcess, instance_id: str) -> list[int]:
    """Every pid `serve` announced for the instance, in order (restarts included)."""
    return [int(line.split()[2]) for line in list(serve.stdout_lines)
            if line.split()[:2] == ["INSTANCE", instance_id]]


def wait_restarted(serve: ServeProcess, instance_id: str, dead: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = instance_pids(serve, instance_id)
        if pids and pids[-1] != dead:
            return pids[-1]
        time.sleep(0.1)
    raise AssertionError(f"instance {instance_id} was not restarted:\n{serve.log()}")


def healthy_instances(serve: ServeProcess, want: list[str], timeout_s: float = 30.0) -> list[str]:
    url = serve.url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                got = sorted(orjson.loads(r.read())["healthy_instances"])
        except urllib.error.HTTPError as exc:  # 503: none healthy yet
            got = sorted(orjson.loads(exc.read())["healthy_instances"])
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_a_replay_completes_while_instances_are_killed_twice(
    serve_cache: Path, tmp_path: Path
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    serve = start_serve(serve_cache, config)
    sessions = [
        replace(s, calls=tuple(replace(c, output_tokens=OUTPUT_TOKENS) for c in s.calls[:CALLS]))
        for s in default_trace()[:SESSIONS]
    ]
    out: dict[str, Any] = {}

    def replay() -> None:
        try:
            out["result"], out["info"] = run_live(live_replay(
                sessions, serve.url, token_scale=0.02, time_scale=0.1, vocab_size=200,
                progress=False,
            ))
        except BaseException as exc:
            out["error"] = repr(exc)
            raise

    runner = threading.Thread(target=replay)
    killed: list[tuple[str, int]] = []
    try:
        runner.start()
        time.sleep(2.0)
        hung = instance_pids(serve, "a")[-1]
        os.kill(hung, signal.SIGSTOP)  # a hangs: it accepts connections, answers nothing
        time.sleep(3.0)
        os.kill(hung, signal.SIGCONT)
        assert runner.is_alive(), "the replay ended during the hang"
        for victim, after_s in (("a", 1.0), ("b", 1.0)):
            time.sleep(after_s)
            pid = instance_pids(serve, victim)[-1]
            assert runner.is_alive(), f"the replay ended before the chaos: {out.get('error')}"
            os.kill(pid, signal.SIGKILL)
            killed.append((victim, pid))
            wait_restarted(serve, victim, pid, timeout_s=120)
        runner.join(timeout=600)
        assert not runner.is_alive(), "the replay did not finish"
        result, info = out["result"], out["info"]
        print(f"chaos replay: {len(result.sessions)} sessions, "
              f"{sum(len(s.calls) for s in result.sessions)} calls, {info['retries']} re-sent, "
              f"1 hang, {len(killed)} kills, {result.wall_s:.1f} s")
        assert len(killed) == 2
        assert len(result.sessions) == SESSIONS
        assert result.failed_calls == 0, [c.error for c in result.calls if c.error]
        assert info["dropped_calls"] == 0
        assert {s.session_id: len(s.calls) for s in result.sessions} == {
            t.session_id: len(t.calls) for t in sessions}  # every call of every session
        for _, pid in killed:
            assert not pid_alive(pid)
        assert healthy_instances(serve, want=["a", "b"]) == ["a", "b"]  # both re-added
    finally:
        code = serve.stop(sig=signal.SIGTERM)
    assert code == 0, serve.log()
