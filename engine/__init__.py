"""The Talaria inference engine: ``from engine import LLM, SamplingParams``.

Exports resolve lazily, so torch-free parts (``engine.interface``, ``engine.block_pool``,
``engine.scheduler``, ...) import without pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore
    from engine.llm import LLM, GenerationOutput
    from engine.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "engine.llm",
    "GenerationOutput": "engine.llm",
    "EngineConfig": "engine.config",
    "EngineCore": "engine.engine_core",
    "SamplingParams": "engine.sampling_params",
}

__all__ = ["LLM", "EngineConfig", "EngineCore", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
