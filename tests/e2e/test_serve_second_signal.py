"""`talaria serve` stopped by a signal gives a call in flight its drain (it keeps streaming);
a second signal ends it at once, told the server is shutting down, and serve exits long
before the drain's end, leaving no process behind."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import openai
import pytest
from serve_process import pid_alive, start_serve

pytestmark = pytest.mark.slow

CONFIG = """
[router]
policy = "talaria"
poll_interval_s = 0.2

[[instances]]
id = "a"
kv_blocks = 512
drain_timeout_s = 300.0
"""


def test_a_second_sigint_ends_the_drain(serve_cache: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    serve = start_serve(serve_cache, config)
    pids = [pid for pid, _url in serve.instances.values()]
    chunks: list[float] = []
    outcome: list[BaseException | str] = []

    def stream() -> None:
        client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0, timeout=600)
        try:
            for _chunk in client.completions.create(
                model="tiny-llama", prompt="once upon a time", max_tokens=4000, stream=True,
                temperature=0.0, extra_body={"ignore_eos": True},
            ):
                chunks.append(time.monotonic())
            outcome.append("finished")
        except BaseException as exc:  # noqa: BLE001 - the test reads which
            outcome.append(exc)

    reader = threading.Thread(target=stream, daemon=True)
    try:
        reader.start()
        while not chunks:
            assert reader.is_alive(), outcome
            time.sleep(0.05)
        serve.proc.send_signal(signal.SIGINT)
        time.sleep(1.5)
        seen = len(chunks)
        time.sleep(1.0)
        assert not outcome and len(chunks) > seen, "the first signal must leave the call its drain"
        first_sent = time.monotonic()
        code = serve.stop(timeout_s=60.0)  # the second SIGINT
        stopped_in = time.monotonic() - first_sent
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()
    reader.join(30.0)
    assert code == 0, serve.log()
    assert stopped_in < 60.0  # the drain was 300 s
    assert len(outcome) == 1 and isinstance(outcome[0], openai.APIError), outcome
    assert "shutting down" in str(outcome[0]), outcome[0]
    assert not any(pid_alive(pid) for pid in pids)
    assert "signal again to end them now" in serve.log()
