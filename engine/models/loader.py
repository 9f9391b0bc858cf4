"""Load a Hugging Face safetensors checkpoint into an engine model, shard by shard.

Each checkpoint tensor is mapped to (parameter name, shard id) and handed, whole, to that
parameter's ``weight_loader``, which copies the slice its rank owns. Afterwards every
parameter must have received all the shards it needs (``required_shards``: one set, or a
tuple of alternative sets such as per-expert tensors vs. fused expert tensors).
Rotary ``inv_freq`` buffers and a tied model's ``lm_head.weight`` are ignored; any other
checkpoint name the model has no parameter for raises.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_QKV = re.compile(r"^(.*\.self_attn)\.(q|k|v)_proj\.(weight|bias)$")
_DENSE_GATE_UP = re.compile(r"^(.*\.mlp)\.(gate|up)_proj\.weight$")
_EXPERT = re.compile(
    r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_FUSED_EXPERTS = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(.*)\.block_sparse_moe\.gate\.weight$")
_EXPERT_PART = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


def map_name(name: str) -> tuple[str, object]:
    """(engine parameter name, shard id) for a checkpoint tensor name."""
    if m := _QKV.match(name):
        return f"{m.group(1)}.qkv_proj.{m.group(3)}", m.group(2)
    if m := _EXPERT.match(name):
        part = _EXPERT_PART[m.group(3)]
        param = "w2" if part == "down" else "w13"
        return f"{m.group(1)}.mlp.experts.{param}", (int(m.group(2)), part)
    if m := _FUSED_EXPERTS.match(name):
        if m.group(2) == "gate_up_proj":
            return f"{m.group(1)}.mlp.experts.w13", "gate_up"
        return f"{m.group(1)}.mlp.experts.w2", "down"
    if m := _ROUTER.match(name):
        return f"{m.group(1)}.mlp.gate.weight", None
    if m := _DENSE_GATE_UP.match(name):
        return f"{m.group(1)}.gate_up_proj.weight", 0 if m.group(2) == "gate" else 1
    return name, None


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (or a single file)."""
    p = Path(path)
    if p.is_file():
        return [p]
    index = p / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [p / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(
                f"checkpoint index {index} names missing files: {', '.join(missing)}"
            )
        return files
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {p}")
    return files


def iter_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def _alternatives(param: nn.Parameter) -> tuple[frozenset[object], ...]:
    required = getattr(param, "required_shards", frozenset({None}))
    return required if isinstance(required, tuple) else (required,)


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``path``; raises ValueError
    naming the tensor for unknown names and shape mismatches, and naming the parameter
    (and missing shards) when the checkpoint lacks something."""
    params = dict(model.named_parameters())
    tied = bool(getattr(getattr(model, "spec", None), "tie_word_embeddings", False))
    loaded: dict[str, set[object]] = {name: set() for name in params}
    for ckpt_name, tensor in iter_tensors(path):
        if ckpt_name.endswith(IGNORED_SUFFIXES) or (tied and ckpt_name == "lm_head.weight"):
            continue
        param_name, shard_id = map_name(ckpt_name)
        param = params.get(param_name)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} (shape {tuple(tensor.shape)}) has no matching "
                f"model parameter {param_name!r}"
            )
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            raise ValueError(f"model parameter {param_name!r} has no weight_loader")
        try:
            loader(param, tensor, shard_id)
        except ValueError as exc:
            raise ValueError(
                f"cannot load checkpoint tensor {ckpt_name!r} (shape {tuple(tensor.shape)}) into "
                f"{param_name!r} (local shape {tuple(param.shape)}): {exc}"
            ) from exc
        loaded[param_name].add(shard_id)
    for name, param in params.items():
        alternatives = _alternatives(param)
        if any(alt <= loaded[name] for alt in alternatives):
            continue
        missing = sorted(map(repr, alternatives[0] - loaded[name]))
        detail = (
            ""
            if alternatives[0] == frozenset({None})
            else f" (missing shards: {', '.join(missing)})"
        )
        raise ValueError(f"checkpoint {path} lacks a tensor for model parameter {name!r}{detail}")
