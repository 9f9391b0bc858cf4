"""`talaria serve` hurrying its instances' drains (a second signal to serve): each instance
must see two signals even when it is not scheduled between the two kills. Two SIGTERMs sent
back to back merge into one pending signal (a standard signal is not queued), and the
instance then drains for its whole ``drain_timeout_s``; here the child holds its signals
blocked while they are sent, which makes that merge certain."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import talaria.serving.serve as serve_module
from talaria.serving.serve import InstanceProcess, _stop_children

CHILD = textwrap.dedent("""
    import asyncio, signal, sys, time
    from talaria.serving.signals import ShutdownSignals

    async def main() -> int:
        signals = ShutdownSignals("child", 300.0, announce=False).install()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        print("ready", flush=True)
        time.sleep(1.0)  # not scheduled: whatever is sent meanwhile stays pending
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            await asyncio.wait_for(signals.hurry.wait(), 5.0)
        except TimeoutError:
            return 3 if signals.stop.is_set() else 4
        return 0

    sys.exit(asyncio.run(main()))
""")


def test_a_hurried_stop_reaches_an_instance_not_scheduled_between_the_signals(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                            start_new_session=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        _stop_children([InstanceProcess("a", proc, tmp_path / "a.ready")], kill_after_s=20.0, hurry=True)
        assert proc.returncode == 0, "the instance saw one signal: its drain was not hurried"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


WAITING = textwrap.dedent("""
    import asyncio, sys
    from talaria.serving.signals import ShutdownSignals

    async def main() -> int:
        signals = ShutdownSignals("child", 300.0, announce=False).install()
        print("ready", flush=True)
        await signals.stop.wait()
        print("draining", flush=True)
        try:
            await asyncio.wait_for(signals.hurry.wait(), 5.0)
        except TimeoutError:
            return 3
        if len(sys.argv) > 1:  # an instance whose hurried drain hangs
            print("hurried", flush=True)
            await asyncio.sleep(60.0)
        return 0

    sys.exit(asyncio.run(main()))
""")

SERVE = textwrap.dedent("""
    import subprocess, sys
    from pathlib import Path
    from talaria.serving.serve import InstanceProcess, _stop_children

    child = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], start_new_session=True)
    assert sys.stdin.readline().strip() == "go"
    _stop_children([InstanceProcess("a", child, Path("a.ready"))], kill_after_s=20.0)
    print("stopped", child.returncode, flush=True)
""")


def _serve_waiting_for_its_instance(*args: str) -> subprocess.Popen[bytes]:
    """A scripted serve (``SERVE``) past its router's drain, waiting for its instance to
    stop (``args``: the instance's behaviour)."""
    serve = subprocess.Popen([sys.executable, "-c", SERVE, WAITING, *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=Path(__file__).resolve().parents[2])
    assert serve.stdin is not None and serve.stdout is not None
    assert serve.stdout.readline().strip() == b"ready"
    serve.stdin.write(b"go\n")
    serve.stdin.flush()
    assert serve.stdout.readline().strip() == b"draining"
    return serve


def test_a_signal_while_serve_waits_for_its_instances_hurries_them() -> None:
    """The router's drain is over and serve waits for its instances, its event loop gone: a
    second Ctrl-C there raised KeyboardInterrupt out of serve's clean-up (the temp dir left
    behind, the instances' drains not cut) where it must hurry them as one during the
    router's drain does."""
    serve = _serve_waiting_for_its_instance()
    try:
        serve.send_signal(signal.SIGINT)
        out, err = serve.communicate(timeout=30.0)
        assert serve.returncode == 0, err.decode()
        assert out.split() == [b"stopped", b"0"], "the instance's drain was not hurried"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_a_signal_after_the_hurry_kills_the_instances_at_once() -> None:
    """An instance whose hurried drain hangs: a further signal to serve SIGKILLs it now, as
    an operator's Ctrl-C could end serve before (not after ``kill_after_s``)."""
    serve = _serve_waiting_for_its_instance("hang")
    try:
        assert serve.stdout is not None
        serve.send_signal(signal.SIGINT)
        assert serve.stdout.readline().strip() == b"hurried"
        serve.send_signal(signal.SIGINT)
        out, err = serve.communicate(timeout=10.0)
        assert serve.returncode == 0, err.decode()
        assert out.split() == [b"stopped", b"-9"]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_a_signal_while_the_hurry_is_sent_kills(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """serve's handler re-entered: a SIGINT that reaches serve while its first hurry is being
    sent (the child answered it at once, and the operator signals again) runs the handler
    inside itself. It must find the hurry sent and SIGKILL; it sent a second SIGINT, which a
    child hung in its hurried drain ignores, so serve waited ``kill_after_s`` (a CI run of
    the test above: serve still running 10 s after the second signal)."""
    sent: list[signal.Signals] = []

    def signal_children(children: list[InstanceProcess], sig: signal.Signals) -> None:
        sent.append(sig)
        if sig == signal.SIGINT and sent.count(signal.SIGINT) == 1:
            signal.raise_signal(signal.SIGINT)  # runs serve's handler before this returns

    class Exited:
        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(serve_module, "_signal_children", signal_children)
    _stop_children([InstanceProcess("a", Exited(), tmp_path / "a.ready")],  # type: ignore[arg-type]
                   kill_after_s=20.0, hurry=True)
    assert sent == [signal.SIGTERM, signal.SIGINT, signal.SIGKILL]
