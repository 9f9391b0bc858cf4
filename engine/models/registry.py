"""Build an engine model from a transformers config by its ``architectures[0]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.models.decoder import CausalLM
from engine.models.decoder_spec import (
    DecoderSpec,
    llama_spec,
    mixtral_spec,
    qwen2_spec,
    qwen3_moe_spec,
    qwen3_spec,
)
from engine.parallel_context import ParallelContext

ARCHITECTURES: dict[str, Callable[[Any], DecoderSpec]] = {
    "LlamaForCausalLM": llama_spec,
    "Qwen2ForCausalLM": qwen2_spec,
    "Qwen3ForCausalLM": qwen3_spec,
    "Qwen3MoeForCausalLM": qwen3_moe_spec,
    "MixtralForCausalLM": mixtral_spec,
}


def architecture_of(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(
            f"config has no 'architectures' entry; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return str(archs[0])


def model_spec(hf_config: Any) -> DecoderSpec:
    arch = architecture_of(hf_config)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[arch](hf_config)


def build_model(
    hf_config: Any, dtype: torch.dtype, parallel: ParallelContext, attn_backend: object
) -> CausalLM:
    """An uninitialised (weights not loaded) model on the current default device, in eval mode.
    Raises ValueError for an unknown architecture or a config the sharding cannot split."""
    model = CausalLM(model_spec(hf_config), parallel, dtype, attn_backend)
    return model.eval()
