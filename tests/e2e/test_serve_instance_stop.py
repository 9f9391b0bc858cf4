"""An instance of a live `talaria serve` stopped with SIGTERM mid-run (an operator restarting
it; serve starts it again) loses no session: its calls still queued go to the other
instance, and a call it cuts mid-answer past its drain is told the server is shutting down
(a 503 the agent re-sends), never "the call failed on its instance" (a 502)."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.slow

CONFIG = """
[router]
policy = "talaria"
poll_interval_s = 0.2

[[instances]]
id = "a"
kv_blocks = 512
drain_timeout_s = 0.05

[[instances]]
id = "b"
kv_blocks = 512
drain_timeout_s = 0.05

[policy]
slot_quantum_s = 1.0
"""
SESSIONS = 6
CALLS = 4
MAX = 96


def test_an_instance_stopped_mid_run_fails_no_call(serve_cache: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    serve = start_serve(serve_cache, config)
    client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=60)
    refusals: list[openai.APIStatusError] = []
    half_way = threading.Barrier(SESSIONS + 1, timeout=120)

    def agent(i: int) -> int:
        model = ("tiny-llama", "tiny-qwen3")[i % 2]
        messages = [{"role": "user", "content": f"Session {i}: fix bug #{i * 7}"}]
        done = 0
        for turn in range(CALLS):
            if turn == 1:
                half_way.wait()  # the SIGTERM comes while calls 2..4 are being sent
            for _attempt in range(4):
                try:
                    chat = client.chat.completions.create(
                        model=model, messages=messages, max_tokens=MAX, temperature=0.0,
                        extra_headers={"X-Session-ID": f"agent-{i}"},
                        extra_body={"ignore_eos": True},
                    )
                    break
                except openai.APIStatusError as exc:  # the agent re-sends, as SDKs do a 503
                    refusals.append(exc)
                    time.sleep(0.2)
            else:
                raise AssertionError(f"session {i} call {turn} failed 4 times")
            assert chat.choices[0].finish_reason == "length"
            done += 1
            messages += [
                {"role": "assistant", "content": chat.choices[0].message.content or ""},
                {"role": "user", "content": f"tool output {turn}: ok"},
            ]
        return done

    try:
        with ThreadPoolExecutor(SESSIONS) as pool:
            futures = [pool.submit(agent, i) for i in range(SESSIONS)]
            half_way.wait()
            time.sleep(0.3)  # calls under way on both instances
            os.kill(serve.instances["a"][0], signal.SIGTERM)
            results = [f.result(timeout=180) for f in futures]
        assert results == [CALLS] * SESSIONS
        assert all(e.status_code == 503 and "shutting down" in str(e) for e in refusals), [
            (e.status_code, str(e)) for e in refusals]
        with urllib.request.urlopen(serve.url.removesuffix("/v1") + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        # the calls it cut (a listener closed first refuses the rest: those are re-placed as
        # unreachable, unseen by their clients)
        assert 'talaria_router_call_failures_total{instance="a",kind="instance_shutdown"}' in metrics
    finally:
        code = serve.stop(sig=signal.SIGTERM)
    assert code == 0, serve.log()
