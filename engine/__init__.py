"""The Talaria inference engine: ``from engine import LLM, SamplingParams``.

The core is flat and small: requests (``request``), the block pool and KV manager with prefix
caching by the chained block hash (``block_pool``, ``kv_cache_manager``, ``block_hash``), the
chunked-prefill scheduler, the sampler (and ``thinking_budget``: the end of a reasoning
model's thinking forced once its budget is spent) and detokenizer, the single-model
``EngineCore`` and ``LLM``, the model runner, and the seam every engine implements
(``interface``, ``served_models``). Packages: ``graphs/`` (the host-sync guard, decode steps replayed from
CUDA graphs), ``models/``, ``layers/``, ``attention/``, ``parallel/`` (tensor-
parallel processes), ``multi_model/`` (a catalog on the substrate), ``sim/`` (the simulated
engine and its cost model).

May import ``substrate`` only; never ``talaria``, ``router`` or ``workloads``. Exports resolve
lazily, so torch-free parts (``engine.interface``, ``engine.block_pool``, ``engine.scheduler``,
``engine.sim``, ...) import without pulling in torch.
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
