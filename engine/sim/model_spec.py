"""Real model configurations as data, and the sizes derived from them.

The bundled catalog (``engine/sim/data/models/*.json``) holds the published ``config.json`` numbers
of real 100B+ checkpoints. The default catalog is Qwen3-235B-A22B (MoE), GLM-4.5-Air (MoE) and
Mistral-Large-2407 (dense, 123B). Mixtral-8x22B is bundled but not a default: its 64k context
window cannot hold SWE-bench sessions, whose prompts reach 127k tokens in the real trace.

Weights are bf16: the dtype these checkpoints are released in and the one an 8-GPU H100/H200
server serves them in at TP=8 without quantisation. An FP8 deployment (e.g.
Qwen/Qwen3-235B-A22B-FP8) is ``spec.with_weight_dtype("float8_e4m3fn")``: its linear layers take
one byte per weight, embeddings and the LM head stay bf16 (as in those checkpoints; the
per-block scales are under 0.01% and left out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

MODELS_DIR = Path(__file__).parent / "data" / "models"


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only (MoE or dense) transformer's shape. Dense models have ``num_experts=0``.

    ``num_dense_layers`` leading layers use a dense MLP of ``dense_intermediate_size``; the rest
    use ``num_experts`` routed experts (``num_experts_per_tok`` active per token) plus
    ``num_shared_experts`` always-active experts, all of ``moe_intermediate_size``.
    """

    name: str
    hf_repo: str
    source: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_dense_layers: int
    dense_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    max_position_embeddings: int
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    reported_total_params: int = 0
    reported_active_params: int = 0
    # The dtype activations travel in (the TP all-reduces): bf16 for the bf16 and FP8
    # checkpoints served on GPUs, the checkpoint's own dtype for an fp32 model on a CPU.
    activation_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                     "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {self.name!r}: {name} must be positive")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: attention heads must be a multiple of KV heads")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(f"model {self.name!r}: num_dense_layers out of range")
        if self.num_dense_layers < self.num_layers and not (
            0 < self.num_experts_per_tok <= self.num_experts
        ):
            raise ValueError(f"model {self.name!r}: MoE layers need 0 < experts_per_tok <= experts")
        for dtype in (self.weight_dtype, self.kv_dtype, self.activation_dtype):
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"model {self.name!r}: unknown dtype {dtype!r}")

    @classmethod
    def load(cls, name: str) -> ModelSpec:
        """Load a bundled model config by catalog name (e.g. ``"qwen3-235b-a22b"``)."""
        path = MODELS_DIR / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"unknown model {name!r}; bundled models: {', '.join(catalog())}")
        return cls.from_dict(orjson.loads(path.read_bytes()))

    @classmethod
    def from_hf_config(cls, model_dir: str | Path, name: str | None = None) -> ModelSpec:
        """The spec of a Hugging Face checkpoint directory, read from its ``config.json``
        (Llama, Qwen2, Qwen3 dense; Qwen3-MoE, Mixtral), served in its own dtype: weights, KV
        and activations all of ``torch_dtype`` (``dtype``), float32 when it names none.
        ``name`` defaults to the directory's name."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{str(model_dir)!r} is not a model directory (no config.json)")
        return hf_config_spec(orjson.loads(path.read_bytes()), name or Path(model_dir).name,
                              str(model_dir))

    @classmethod
    def from_dict(cls, data: dict) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"model config {data.get('name')!r}: unknown fields {unknown}")
        missing = sorted(
            f.name for f in dataclasses.fields(cls)
            if f.name not in data and f.default is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"model config {data.get('name')!r}: missing fields {missing}")
        return cls(**data)

    def with_weight_dtype(self, dtype: str) -> ModelSpec:
        return dataclasses.replace(self, weight_dtype=dtype)

    # --- parameter counts -------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def attention_params_per_layer(self) -> int:
        q = self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        weights = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        bias = (q + 2 * kv) if self.attention_bias else 0
        return weights + bias

    @property
    def expert_params(self) -> int:
        """One routed or shared expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus LM head (counted once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def router_params_per_moe_layer(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def always_active_linear_params(self) -> int:
        """Linear parameters every token touches, embeddings excluded (attention, dense MLPs,
        shared experts, routers)."""
        moe = self.num_moe_layers * (
            self.num_shared_experts * self.expert_params + self.router_params_per_moe_layer
        )
        return (
            self.num_layers * self.attention_params_per_layer
            + self.num_dense_layers * self.dense_mlp_params
            + moe
        )

    @property
    def routed_expert_params(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        return self.always_active_linear_params + self.routed_expert_params + self.embedding_params

    @property
    def active_linear_params(self) -> int:
        """Linear parameters one token multiplies by (embeddings and LM head excluded)."""
        return (
            self.always_active_linear_params
            + self.num_moe_layers * self.num_experts_per_tok * self.expert_params
        )

    @property
    def active_params(self) -> int:
        return self.active_linear_params + self.embedding_params

    # --- bytes ------------------------------------------------------------------------------
    @property
    def weight_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def kv_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def activation_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.activation_dtype]

    @property
    def embedding_bytes(self) -> int:
        """Embeddings and LM head stay bf16 in the FP8 checkpoints, so never under 2 bytes."""
        return self.embedding_params * max(2, self.weight_dtype_bytes)

    @property
    def weight_bytes(self) -> int:
        linear = self.always_active_linear_params + self.routed_expert_params
        return linear * self.weight_dtype_bytes + self.embedding_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers (unsharded)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


def catalog() -> list[str]:
    """Names of the bundled model configs."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


DEFAULT_CATALOG: tuple[str, ...] = ("qwen3-235b-a22b", "glm-4.5-air", "mistral-large-2407")


_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
_DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def hf_config_spec(cfg: dict, name: str, source: str) -> ModelSpec:
    """A ``ModelSpec`` from a parsed Hugging Face ``config.json`` (see
    :meth:`ModelSpec.from_hf_config`)."""
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in _MOE_ARCHITECTURES + _DENSE_ARCHITECTURES:
        known = ", ".join(_DENSE_ARCHITECTURES + _MOE_ARCHITECTURES)
        raise ValueError(f"model {name!r}: architecture {arch!r} is not one of {known}")
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    experts, per_tok, expert_size, sparse = 0, 0, 0, 0
    if arch == "MixtralForCausalLM":
        experts = int(cfg["num_local_experts"])
        per_tok, expert_size = int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"])
        sparse = layers
    elif arch == "Qwen3MoeForCausalLM":
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        per_tok, expert_size = int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"])
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        sparse = sum(1 for i in range(layers)
                     if experts > 0 and i not in dense_only and (i + 1) % step == 0)
    return ModelSpec(
        name=name,
        hf_repo="",
        source=f"config.json of {source}",
        architecture=arch,
        num_layers=layers,
        hidden_size=int(cfg["hidden_size"]),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        num_dense_layers=layers - sparse,
        dense_intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_experts=experts,
        num_experts_per_tok=per_tok,
        moe_intermediate_size=expert_size,
        num_shared_experts=0,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        weight_dtype=dtype,
        kv_dtype=dtype,
        activation_dtype=dtype,
    )


def resolve_catalog(catalog: Mapping[str, ModelSpec] | Sequence[str]) -> dict[str, ModelSpec]:
    """A simulated engine's catalog: specs given by name, or model names loaded as bundled."""
    if isinstance(catalog, str):
        raise TypeError("catalog must be a list of model names or a name -> ModelSpec mapping")
    specs = dict(catalog) if isinstance(catalog, Mapping) else {n: ModelSpec.load(n) for n in catalog}
    if not specs:
        raise ValueError("the catalog must name at least one model")
    return specs
