"""The live replay driver: token/time scaling, and a small trace replayed over HTTP against a
real `talaria serve` (subprocess, tiny CPU models in a temp cache) completing every session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from talaria.clock import run_live
from workloads.replay.live import base_url, live_replay, scale_sessions
from workloads.traces.generator import default_trace
from workloads.traces.trace import Call, Session

REPO = Path(__file__).resolve().parents[3]


def test_scale_sessions_keeps_prompts_growing_and_drops_what_does_not_fit() -> None:
    s = Session("s", "m", (Call(1000, 100, 1.0), Call(1004, 50, 2.0), Call(3000, 400, None)))
    scaled, dropped = scale_sessions([s], 0.1, max_context=250)
    calls = scaled[0].calls
    assert [c.input_tokens for c in calls] == [100, 101]  # 100.4 rounds to 100: forced to grow
    assert [c.output_tokens for c in calls] == [10, 5]
    assert calls[-1].tool_gap_s is None and dropped == 1
    with pytest.raises(ValueError, match="first call does not fit"):
        scale_sessions([s], 1.0, max_context=500)
    with pytest.raises(ValueError, match="token_scale"):
        scale_sessions([s], 0.0, max_context=500)


def test_base_url_accepts_the_openai_base() -> None:
    assert base_url("http://h:1/v1") == "http://h:1"
    assert base_url("http://h:1/") == "http://h:1"


def _start_serve(cache: Path, timeout_s: float = 240.0) -> tuple[subprocess.Popen[str], str, list[str]]:
    env = {**os.environ, "TALARIA_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "talaria.cli", "serve", "--port", "0", "--tiny-only"], cwd=REPO, env=env,
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    out: list[str] = []
    err: list[str] = []
    for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=lambda s=stream, k=sink: k.extend(s), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for line in list(out):
            if line.startswith("ROUTER_READY "):
                return proc, line.split()[1], err
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise AssertionError("talaria serve did not become ready:\n" + "".join(err[-40:]))


@pytest.mark.slow
def test_live_replay_against_talaria_serve_completes_every_session(tmp_path: Path) -> None:
    proc, url, err = _start_serve(tmp_path / "cache")
    try:
        trace = default_trace()[:3]
        result, info = run_live(live_replay(
            trace, url, token_scale=0.02, time_scale=0.01, vocab_size=200, progress=False,
        ))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert result.failed_calls == 0, [c.error for c in result.calls if c.error]
    assert len(result.sessions) == 3
    served = {"tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"}
    expected_calls = sum(s.num_calls for s in trace) - info["dropped_calls"]
    assert len(result.calls) == expected_calls
    for s in result.sessions:
        assert s.model in served  # trace models were mapped onto the served catalog
        assert s.sct_s > 0 and all(c.ttft_s is not None for c in s.calls)
        # Outputs came back at the forced length (ignore_eos, max_tokens = the trace's).
        assert all(c.output_tokens >= 1 for c in s.calls)
        # Continuations hit the instance's prefix cache (the previous prompt is a prefix).
        assert sum(c.cached_tokens for c in s.calls[1:]) > 0
