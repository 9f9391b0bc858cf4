"""Router test fixtures: the tiny tokenizer, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from router_fakes import write_tiny_tokenizer, write_tokenizer

from router.tokenization import ModelTokenizer


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.load("tiny", model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models' tokenizer and chat template (with tools)."""
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tools-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.load("tiny", tiny_model_dir)
