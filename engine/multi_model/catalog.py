"""A multi-model engine's catalog: each model's config, weight layout, KV shape and tokenizer,
read without touching its weights; and the fill that loads its shard into a host buffer.

Layouts come from the model built on the meta device (parameters, then buffers such as the
rotary ``inv_freq``), so every rank can size its arena before any weight is read. The fill
builds the model on the CPU, loads the checkpoint through the per-parameter weight loaders
(this rank's shard) and copies every tensor into the host weight store's views; the CPU
copy is dropped afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention.torch_paged import TorchPagedAttention
from engine.model_runner import resolve_dtype
from engine.models.decoder import CausalLM
from engine.models.loader import load_checkpoint
from engine.models.registry import build_model
from engine.parallel_context import SINGLE, ParallelContext
from substrate.host_weights import FillFn
from substrate.instance_memory import KVSpec
from substrate.layout import WeightLayout


@dataclass
class CatalogEntry:
    """One model of the catalog, as this rank sees it."""

    name: str
    path: Path
    hf_config: Any
    dtype: torch.dtype
    layout: WeightLayout
    kv_spec: KVSpec
    tokenizer: Any = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_spec.block_bytes / self.kv_spec.block_size


def read_catalog(
    models: Mapping[str, str | Path],
    dtype: str | torch.dtype,
    block_size: int,
    parallel: ParallelContext = SINGLE,
    load_tokenizers: bool = True,
) -> dict[str, CatalogEntry]:
    """Config, meta-device layout, KV shape and tokenizer of every model; raises ValueError
    naming the model for a missing config, an unknown architecture, or a tokenizer with
    more tokens than the model's vocabulary."""
    from transformers import AutoConfig

    if not models:
        raise ValueError("the model catalog is empty")
    out: dict[str, CatalogEntry] = {}
    for name, raw_path in models.items():
        path = Path(raw_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model {name!r}: no config.json in {str(path)!r}")
        hf_config = AutoConfig.from_pretrained(path)
        model_dtype = resolve_dtype(dtype, hf_config)
        try:
            with torch.device("meta"):
                meta = build_model(hf_config, model_dtype, parallel, TorchPagedAttention())
        except ValueError as exc:
            raise ValueError(f"model {name!r} ({path}): {exc}") from exc
        num_layers, kv_heads, head_dim = meta.kv_cache_spec()
        tokenizer = _load_tokenizer(path) if load_tokenizers else None
        entry = CatalogEntry(
            name=name,
            path=path,
            hf_config=hf_config,
            dtype=model_dtype,
            layout=WeightLayout.from_module(meta),
            kv_spec=KVSpec(num_layers, block_size, kv_heads, head_dim, model_dtype),
            tokenizer=tokenizer,
        )
        check_vocab(entry)
        out[name] = entry
    return out


def check_vocab(entry: CatalogEntry) -> None:
    """The tokenizer must not produce ids the model has no embedding for."""
    if entry.tokenizer is None:
        return
    num_tokens = len(entry.tokenizer)
    if num_tokens > entry.vocab_size:
        raise ValueError(
            f"model {entry.name!r}: its tokenizer has {num_tokens} tokens but the model's "
            f"vocab_size is {entry.vocab_size} ({entry.path})"
        )


def build_meta_model(
    entry: CatalogEntry, backend: object, parallel: ParallelContext = SINGLE
) -> CausalLM:
    """The model on the meta device, ready to be bound to the weight region."""
    with torch.device("meta"):
        return build_model(entry.hf_config, entry.dtype, parallel, backend)


def checkpoint_fill(entry: CatalogEntry, parallel: ParallelContext = SINGLE) -> FillFn:
    """A ``FillFn`` loading ``entry``'s shard from its safetensors into the given views.
    Shape mismatches between checkpoint and config (e.g. a wrong ``vocab_size``) raise
    ValueError naming the model and both shapes."""

    def fill(views: dict[str, torch.Tensor]) -> None:
        with torch.device("cpu"):
            model = build_model(entry.hf_config, entry.dtype, parallel, TorchPagedAttention())
        try:
            load_checkpoint(model, entry.path)
        except ValueError as exc:
            raise ValueError(f"model {entry.name!r}: {exc}") from exc
        tensors = dict(model.named_parameters())
        tensors.update(dict(model.named_buffers()))
        for key, view in views.items():
            src = tensors[key]
            if tuple(src.shape) != tuple(view.shape) or src.dtype != view.dtype:
                raise ValueError(
                    f"model {entry.name!r}: tensor {key!r} is {src.dtype} {tuple(src.shape)}, "
                    f"the layout says {view.dtype} {tuple(view.shape)}"
                )
            with torch.no_grad():
                view.copy_(src)

    return fill


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    has_files = any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    )
    if not has_files:
        return None
    return AutoTokenizer.from_pretrained(path)
