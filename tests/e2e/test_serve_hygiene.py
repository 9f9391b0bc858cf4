"""What `talaria serve` leaves where an operator looks: instances that a stray module in the
working directory cannot break, no key on disk (not even after SIGKILL), a private config
file, and on the live router and instance alike a 401 for a key that is not UTF-8 and a JSON
error for a request aiohttp cannot parse."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import orjson
import pytest
from serve_process import pid_alive, start_serve

from talaria.serving.serve import instance_command

API_KEY = "router-api-key-0123456789"
INSTANCE_KEY = "instance-key-0123456789abcdef"
CONFIG = f"""
[router]
api_key = "{API_KEY}"
instance_key = "{INSTANCE_KEY}"

[[instances]]
id = "a"
kv_blocks = 64
drain_timeout_s = 1.0
"""
STRAY = 'raise RuntimeError("a stray module in the working directory was imported")\n'


def test_an_instance_does_not_import_from_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "orjson.py").write_text(STRAY)  # talaria.cli imports orjson
    cmd = [*instance_command("x", tmp_path / "c.json", tmp_path / "ready"), "--help"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--ready-file" in done.stdout


def raw(url: str, head: bytes) -> tuple[int, str, bytes]:
    """One request sent as raw bytes to ``url``'s host and port: (status, content type, body)."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + b"\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    header, _, body = data.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), fields.get("Content-Type", ""), body


def get(path: bytes, *headers: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + b"".join(
        h + b"\r\n" for h in headers)


@pytest.mark.slow
def test_serve_keeps_its_keys_off_disk_and_answers_raw_abuse_in_json(
    serve_cache: Path, tmp_path: Path
) -> None:
    work = tmp_path / "cwd"
    temp = tmp_path / "tmp"
    work.mkdir()
    temp.mkdir()
    (work / "orjson.py").write_text(STRAY)
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG)
    serve = start_serve(serve_cache, config, cwd=work, env={"TMPDIR": str(temp)})
    try:
        pids = serve.descendants()
        (config_file,) = temp.glob("talaria-serve-*/serve.json")
        assert stat.S_IMODE(config_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(config_file.parent.stat().st_mode) == 0o700
        text = config_file.read_text()
        assert API_KEY not in text and INSTANCE_KEY not in text
        router = serve.url.removesuffix("/v1")
        (_pid, instance) = serve.instances["a"]
        for url, path in ((router, b"/v1/models"), (instance, b"/internal/v1/state")):
            status, kind, body = raw(url, get(path, b"Authorization: Bearer \xff\xfe\x80"))
            assert status == 401 and kind.startswith("application/json"), body
            status, kind, body = raw(url, get(path, b"X-Big: " + b"a" * 9000))
            assert status == 400 and kind.startswith("application/json"), body
            assert orjson.loads(body)["error"]["code"] == "bad_http_request"
        status, _, body = raw(instance, get(b"/internal/v1/state",
                                            b"Authorization: Bearer " + INSTANCE_KEY.encode()))
        assert status == 200, body  # the instance got its key, from its environment
        status, _, body = raw(router, get(b"/v1/models", b"x-api-key: \xc3\x28"))
        assert status == 401, body
    finally:
        serve.proc.send_signal(signal.SIGKILL)  # no clean-up runs in serve itself
        serve.proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)]
    for path in temp.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert API_KEY.encode() not in data and INSTANCE_KEY.encode() not in data, path
    assert os.environ.get("TALARIA_INSTANCE_KEY") is None
