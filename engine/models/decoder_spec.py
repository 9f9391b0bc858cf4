"""What the shared decoder needs to know about a model, read from its HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.layers.activation import check_activation
from engine.layers.rotary import RopeConfig, rope_config_from_hf


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: frozenset[int]  # layers whose MLP is sparse; the others are dense


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    rope: RopeConfig
    moe: MoESpec | None = None
    checkpoint_moe_prefix: str = "mlp"  # "block_sparse_moe" for Mixtral checkpoints


def _check_common(cfg: Any) -> None:
    check_activation(getattr(cfg, "hidden_act", "silu"))
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError("sliding-window attention is not supported")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")


def dense_spec(
    cfg: Any, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, **extra: Any
) -> DecoderSpec:
    _check_common(cfg)
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return DecoderSpec(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        rope=rope_config_from_hf(cfg),
        **extra,
    )


def llama_spec(cfg: Any) -> DecoderSpec:
    bias = bool(getattr(cfg, "attention_bias", False))
    return dense_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm=False)


def qwen2_spec(cfg: Any) -> DecoderSpec:
    return dense_spec(cfg, qkv_bias=True, o_bias=False, qk_norm=False)


def qwen3_spec(cfg: Any) -> DecoderSpec:
    bias = bool(getattr(cfg, "attention_bias", False))
    return dense_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True)


def qwen3_moe_spec(cfg: Any) -> DecoderSpec:
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    sparse = frozenset(
        i
        for i in range(cfg.num_hidden_layers)
        if i not in mlp_only and cfg.num_experts > 0 and (i + 1) % step == 0
    )
    moe = MoESpec(
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate_size=cfg.moe_intermediate_size,
        renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
        sparse_layers=sparse,
    )
    bias = bool(getattr(cfg, "attention_bias", False))
    return dense_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=moe)


def mixtral_spec(cfg: Any) -> DecoderSpec:
    if getattr(cfg, "sliding_window", None) is not None:
        raise ValueError("sliding-window attention is not supported (config.sliding_window is set)")
    moe = MoESpec(
        num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        intermediate_size=cfg.intermediate_size,
        renormalize=True,
        sparse_layers=frozenset(range(cfg.num_hidden_layers)),
    )
    return dense_spec(
        cfg,
        qkv_bias=False,
        o_bias=False,
        qk_norm=False,
        moe=moe,
        checkpoint_moe_prefix="block_sparse_moe",
    )
