"""`talaria fidelity` refuses bad arguments before it measures or writes anything (a run
takes the best part of an hour, and a bad policy or output path was found only at its end)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from talaria.bench import calibrate as calibrate_module
from talaria.cli import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--sessions", "0"], "--sessions must be >= 1, got 0"),
    (["--kv-blocks", "-1"], "--kv-blocks must be >= 1, got -1"),
    (["--policies", "baseline,nope"], "--policies: unknown policy 'nope'"),
    (["--real-policies", "vllm_sleep"], "--real-policies: 'vllm_sleep' cannot be served live"),
    (["--json", "no-such-folder/f.json"], "cannot write no-such-folder/f.json"),
    (["--server", "no-such-folder/s.json"], "cannot write no-such-folder/s.json"),
    (["--json", "."], "cannot write .: it is a folder"),  # was found when the run wrote it
    (["--server", "."], "cannot write .: it is a folder"),
    # contradictions: each ran the calibration (minutes), compared nothing and exited 0
    (["--real-model-only", "--no-real-model"],
     "--real-model-only and --no-real-model leave nothing to run"),
    (["--skip-steps", "--skip-replay"], "--skip-steps and --skip-replay leave nothing to compare"),
    (["--real-model-only", "--skip-steps", "--skip-replay"],
     "--skip-steps and --skip-replay leave nothing to compare"),
])
def test_bad_arguments_are_refused_before_anything_runs(
        argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def measured(*_: Any, **__: Any) -> Any:
        raise AssertionError("calibrated before checking the arguments")

    monkeypatch.setattr(calibrate_module, "calibrate_here", measured)
    monkeypatch.setenv("TALARIA_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(["fidelity", *argv]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no models, spec or JSON written
