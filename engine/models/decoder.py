"""One decoder-only transformer for Llama, Qwen2, Qwen3 (dense) and Qwen3-MoE, Mixtral.

Options from ``DecoderSpec``: q/k/v (and o) bias, per-head q/k RMSNorm, GQA, RoPE scaling,
tied embeddings, and a sparse-MoE MLP on the layers that have one. Parameter names follow
the Hugging Face layout with merged projections (``self_attn.qkv_proj``, ``mlp.gate_up_proj``,
``mlp.experts.w13`` / ``w2``, ``mlp.gate``), so the loader maps checkpoint names directly.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.layers.activation import SiluAndMul
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.moe import SparseMoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.decoder_spec import DecoderSpec
from engine.parallel_context import ParallelContext


class Attention(nn.Module):
    def __init__(
        self, spec: DecoderSpec, parallel: ParallelContext, dtype: torch.dtype, backend: object
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size,
            spec.head_dim,
            spec.num_heads,
            spec.num_kv_heads,
            spec.qkv_bias,
            parallel,
            dtype,
        )
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, spec.o_bias, parallel, dtype
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        if spec.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
            self.k_norm: RMSNorm | None = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope)
        self.backend = backend

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        out = self.backend.forward(q, k, v, k_cache, v_cache, attn, self.scale)  # type: ignore[attr-defined]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DenseMLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, parallel: ParallelContext, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], False, parallel, dtype
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, False, parallel, dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        index: int,
        spec: DecoderSpec,
        parallel: ParallelContext,
        dtype: torch.dtype,
        backend: object,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(spec, parallel, dtype, backend)
        self.mlp: nn.Module
        if spec.moe is not None and index in spec.moe.sparse_layers:
            m = spec.moe
            self.mlp = SparseMoE(
                m.num_experts,
                m.top_k,
                spec.hidden_size,
                m.intermediate_size,
                m.renormalize,
                parallel,
                dtype,
            )
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, parallel, dtype)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), attn, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(
        self, spec: DecoderSpec, parallel: ParallelContext, dtype: torch.dtype, backend: object
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, parallel, dtype
        )
        self.layers = nn.ModuleList(
            DecoderLayer(i, spec, parallel, dtype, backend) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """``forward`` -> final hidden states; ``compute_logits`` -> full-vocab float32 logits."""

    def __init__(
        self, spec: DecoderSpec, parallel: ParallelContext, dtype: torch.dtype, backend: object
    ) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        self.model = DecoderModel(spec, parallel, dtype, backend)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, parallel, dtype)
        if spec.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @property
    def num_local_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads  # type: ignore[union-attr]

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_local_kv_heads, head_dim) for allocating the paged caches."""
        return self.spec.num_layers, self.num_local_kv_heads, self.spec.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        if len(kv_caches) != self.spec.num_layers:
            raise ValueError(
                f"expected {self.spec.num_layers} KV caches (one per layer), got {len(kv_caches)}"
            )
        if input_ids.shape != positions.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ in shape"
            )
        h = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(positions, h, attn, kv_cache)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
