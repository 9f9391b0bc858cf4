"""Router test fixtures: the tiny tokenizer, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from router_fakes import write_tokenizer

from router.tokenization import ModelTokenizer


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.load("tiny", model_dir)
