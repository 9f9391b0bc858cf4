"""The real multi-model engine on two tiny models, sized for instance tests (CPU, small KV)."""

from __future__ import annotations

from pathlib import Path

from engine.multi_model.engine import MultiModelConfig, MultiModelEngine

LLAMA, QWEN = "tiny-llama", "tiny-qwen3"
BLOCK = 4
NUM_BLOCKS = 96


def real_engine(
    tiny_models: dict[str, Path], initial: str | None = LLAMA, **config: object
) -> MultiModelEngine:
    """Llama and Qwen3 on one CPU arena; ``initial`` active at start."""
    settings: dict[str, object] = dict(
        device="cpu", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, host_kv_bytes=4 << 20,
        initial_model=initial, max_num_seqs=16,
    )
    settings.update(config)
    models = {LLAMA: tiny_models[LLAMA], QWEN: tiny_models[QWEN]}
    return MultiModelEngine(models, MultiModelConfig(**settings))  # type: ignore[arg-type]
