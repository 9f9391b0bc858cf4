"""`talaria calibrate` refuses bad arguments before it measures or writes anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from talaria.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--out", "no-such-folder/spec.json"], "its folder does not exist"),
    (["--out", "."], "it is a folder"),
])
def test_bad_arguments_are_refused_before_any_file_is_written(
        argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TALARIA_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    argv = ["--out", "spec.json", *argv] if "--out" not in argv else argv
    assert main(["calibrate", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not cache.exists()  # the tiny models it calibrates on were not written
    assert not (tmp_path / "spec.json").exists()
