"""A llama-architecture GGUF file read as a Hugging Face checkpoint: its config, its tensors
dequantized to float32 under Hugging Face names, and the metadata the tokenizer is built from.

llama.cpp's converter permutes the rows of every llama attention ``q`` and ``k`` weight
(per head, the two rotary halves interleaved: rows ``[h, 2, d/2]`` stored as ``[h, d/2, 2]``,
so that ggml's adjacent-pair rotary applies). The engine, like transformers, rotates halves,
so :func:`unpermute_rows` puts those rows back; a model loaded without it answers gibberish.

Reading and dequantizing go through the ``gguf`` package (``GGUFReader``,
``gguf.quants.dequantize``); it is imported when a file is opened.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["GGUFCheckpoint", "unpermute_rows", "hf_tensor_name"]

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face llama name of a GGUF tensor; ValueError for one it has no place for
    (e.g. ``rope_freqs.weight`` of a llama-3.1 file, which this reader does not support)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no llama parameter to load into")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q (``num_heads``) or k (KV heads)
    projection: rows stored per head as ``[d/2, 2]`` go back to ``[2, d/2]``."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of rotary pairs")
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@dataclass(frozen=True)
class GGUFCheckpoint:
    """An opened GGUF file of the ``llama`` architecture."""

    path: Path
    reader: Any  # gguf.GGUFReader

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        import gguf

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        try:
            reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
        ckpt = cls(path, reader)
        arch = ckpt.field("general.architecture")
        if arch != "llama":
            raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
        return ckpt

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalars as Python values, arrays as lists), or ``default``."""
        entry = self.reader.fields.get(key)
        return default if entry is None else entry.contents()

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.field(f"llama.{key}", default)

    @property
    def num_heads(self) -> int:
        return int(self._arch("attention.head_count"))

    @property
    def num_kv_heads(self) -> int:
        return int(self._arch("attention.head_count_kv", self.num_heads))

    def tokenizer_metadata(self) -> dict[str, Any]:
        """Every ``tokenizer.*`` field, by its full key."""
        return {k: self.field(k) for k in self.reader.fields if k.startswith("tokenizer.")}

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.reader.tensors]

    def hf_config(self) -> dict[str, Any]:
        """config.json of the equivalent ``LlamaForCausalLM`` (float32, the dequantized
        weights' dtype); ValueError for RoPE scaling this reader does not translate."""
        hidden = int(self._arch("embedding_length"))
        heads = self.num_heads
        head_dim = int(self._arch("attention.key_length", self._arch("rope.dimension_count",
                                                                       hidden // heads)))
        if self._arch("rope.scaling.type", "none") not in ("none", None):
            raise ValueError(f"{self.path}: RoPE scaling "
                             f"{self._arch('rope.scaling.type')!r} is not supported")
        if "rope_freqs.weight" in self.tensor_names():
            raise ValueError(f"{self.path}: per-frequency RoPE factors (rope_freqs) are not "
                             "supported")
        tokens = self.field("tokenizer.ggml.tokens") or []
        vocab = int(self._arch("vocab_size", len(tokens)))
        has_bias = "blk.0.attn_q.bias" in self.tensor_names()
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": int(self._arch("context_length")),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "attention_bias": has_bias,
            "mlp_bias": False,
            "tie_word_embeddings": "output.weight" not in self.tensor_names(),
            "torch_dtype": "float32",
        }
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            value = self.field(f"tokenizer.ggml.{key}")
            if value is not None:
                config[key.replace("padding", "pad")] = int(value)
        return config

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every tensor, dequantized, q/k rows
        un-permuted."""
        from gguf.quants import dequantize

        for t in self.reader.tensors:
            name = hf_tensor_name(t.name)
            weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            expected = tuple(int(d) for d in reversed(t.shape.tolist()))
            if weight.size != int(np.prod(expected)):
                raise ValueError(f"GGUF tensor {t.name!r}: {weight.size} values for shape "
                                 f"{expected}")
            weight = weight.reshape(expected)
            if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
                weight = unpermute_rows(weight, self.num_heads)
            elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
                weight = unpermute_rows(weight, self.num_kv_heads)
            yield name, torch.from_numpy(np.require(weight, requirements=["C", "W"]))
