"""Shared fixtures for the end-to-end tests: one Talaria cache dir for every `talaria serve`
subprocess of the session (the first one writes the tiny models into it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def serve_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("talaria-cache")


@pytest.fixture
def serve_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> Callable[[str, str], str]:
    """``refused(before_models, after_models)``: runs ``talaria serve`` on a config of one tiny
    random model ``m`` with those TOML lines around its ``[models.m]`` table, checks that it
    exits 2 having started no instance process, and returns what it wrote to stderr."""
    from engine.models.tiny import write_random_checkpoint
    from talaria.cli import main
    from talaria.serving import serve as serve_module

    def spawned(*_args: object, **_kw: object) -> None:
        raise AssertionError("an instance was started")

    monkeypatch.setattr(serve_module.subprocess, "Popen", spawned)
    path = write_random_checkpoint(tmp_path / "m", "llama")

    def refused(before_models: str, after_models: str = "") -> str:
        file = tmp_path / "serve.toml"
        file.write_text(f'[router]\nport = 0\n{before_models}[models.m]\npath = "{path}"\n'
                        f"{after_models}")
        assert main(["serve", "--config", str(file), "--log-level", "error"]) == 2
        return capsys.readouterr().err

    return refused
