"""Runs one scheduled step on the model: KV tensor, input preparation, forward, sampling.

The KV cache is one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
(the layout nano-vllm and flash-attn's paged API use). The runner allocates it, or takes a
caller-supplied one (e.g. a view of a device arena) that it never reallocates. A step is
three parts: ``prepare`` (host work: token ids, positions, slots and attention metadata,
built once per step and moved in one copy), ``forward_step`` (the model and the logits of
the sampled rows: device work only, no host synchronisation, the part a CUDA graph captures
when ``prepare`` is given a ``FixedShape``), and sampling (where a request's thinking budget
may force its token, ``engine.thinking_budget``). Logits are computed only for the
last scheduled token of sequences that reach their end this step (the ones that yield a
token). On a CPU (torch backend), decode groups keep their gathered context across steps
(``engine.attention.decode_context``, at most the KV cache's size again); on a GPU the
memory is the KV cache's, and flash-attn reads the paged cache in place.

KV restored from host during scheduling is queued here (``queue_kv_load``) and written into
the cache by the forward pass itself, a group of layers before the first of them runs
(``substrate.layer_loads``); ``execute`` settles whatever is left, even when it raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention.decode_context import DecodeContexts
from engine.attention.metadata import (
    AttentionMetadata,
    FixedShape,
    build_attention_metadata,
    copy_into,
)
from engine.config import EngineConfig
from engine.graphs.decode import DecodeGraphs
from engine.parallel_context import SINGLE, ParallelContext
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.thinking_budget import forced_tokens
from substrate.layer_loads import LayerwiseKVLoad
from substrate.moves import MoveRecord

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
DTYPE_NAMES = ("auto", *sorted(_DTYPES))  # what ``dtype`` settings may name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype, hf_config: Any) -> torch.dtype:
    """``"auto"``: the checkpoint's dtype, float32 when it names none."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if found is None:
            return torch.float32
        if isinstance(found, torch.dtype):
            return found
        name = str(found).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


@dataclass
class SampledToken:
    request_id: str
    token_id: int
    logprob: float | None


@dataclass
class StepInputs:
    """What ``forward_step`` reads (device tensors, fixed shapes under a ``FixedShape``) and
    how many of its logit rows are real (the rest pad a fixed-shape batch)."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    logit_rows: torch.Tensor  # [num_logit_rows] token rows whose logits are computed
    num_samples: int

    def copy_(self, other: StepInputs) -> None:
        """Take ``other``'s values into these tensors in place (a captured graph's static
        inputs, refreshed for a new step of the same ``FixedShape``)."""
        copy_into(
            (self.input_ids, self.positions, self.attn, self.logit_rows),
            (other.input_ids, other.positions, other.attn, other.logit_rows),
        )
        self.num_samples = other.num_samples


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache: torch.Tensor | None = None,
        hf_config: Any = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self.hf_config = hf_config
        shape = model.kv_cache_shape(num_blocks, block_size)
        if kv_cache is None:
            kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        if tuple(kv_cache.shape) != shape:
            raise ValueError(f"KV cache has shape {tuple(kv_cache.shape)}, expected {shape}")
        self.kv_cache = kv_cache
        self.kv_loads = LayerwiseKVLoad(device)
        self._kv_load_records: list[MoveRecord] = []
        self.decode_contexts: DecodeContexts | None = None
        if device.type == "cpu" and getattr(model.attn_backend, "name", None) == "torch":
            num_layers, _, _, _, kv_heads, head_dim = shape
            self.decode_contexts = DecodeContexts(
                num_layers,
                kv_heads,
                head_dim,
                block_size,
                dtype,
                device,
                budget_bytes=kv_cache.numel() * kv_cache.element_size(),
            )
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.sampler = Sampler(gen)
        self.decode_graphs: DecodeGraphs | None = None

    def use_decode_graphs(self, max_seqs: int, max_blocks: int) -> DecodeGraphs:
        """Run decode-only steps in fixed-shape buckets from now on (``engine.graphs.decode``):
        replayed from CUDA graphs on a GPU, eagerly elsewhere (the same path, testable on a
        CPU). The buckets' padded steps replace the kept decode contexts of a CPU."""
        self.decode_contexts = None
        # a MoE layer runs every expert (no host sync) only up to its dense_max_tokens
        dense = [m.dense_max_tokens for m in self.model.modules() if hasattr(m, "dense_max_tokens")]
        self.decode_graphs = DecodeGraphs(self.forward_step, min([max_seqs, *dense]), max_blocks,
                                          capture=self.device.type == "cuda",
                                          block_size=self.block_size)
        return self.decode_graphs

    # ----------------------------------------------------------------- building
    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        kv_cache: torch.Tensor | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> ModelRunner:
        """Build the model from ``config.model`` (HF directory), load weights, size the KV."""
        from transformers import AutoConfig

        from engine.attention.selector import get_attention_backend
        from engine.models.loader import load_checkpoint
        from engine.models.registry import build_model

        path = Path(config.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
        hf_config = AutoConfig.from_pretrained(path)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, hf_config)
        backend = get_attention_backend(
            config.attention_backend, device=device, block_size=config.block_size,
            dtypes=(dtype,),
        )
        with torch.device(device):
            model = build_model(hf_config, dtype, parallel, backend)
        load_checkpoint(model, path)
        model.eval()
        if kv_cache is not None:
            num_blocks = kv_cache.shape[2]
        else:
            num_blocks = cls.choose_num_blocks(config, model, hf_config, dtype, device)
        return cls(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            vocab_size=int(hf_config.vocab_size),
            device=device,
            dtype=dtype,
            kv_cache=kv_cache,
            hf_config=hf_config,
            seed=config.seed,
        )

    @staticmethod
    def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        num_layers, kv_heads, head_dim = model.kv_cache_spec()
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * kv_heads * head_dim * elem

    @classmethod
    def choose_num_blocks(
        cls,
        config: EngineConfig,
        model: torch.nn.Module,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
    ) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = cls.kv_bytes_per_block(model, config.block_size, dtype)
        max_len = config.max_model_len or int(hf_config.max_position_embeddings)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return max(1, int(free * config.kv_memory_fraction) // per_block)
        available = _host_available_bytes()
        needed = config.max_num_seqs * -(-max_len // config.block_size)
        return max(1, min(needed, int(available * config.kv_memory_fraction) // per_block))

    # ------------------------------------------------------------------ running
    def prepare(self, out: SchedulerOutput, fixed: FixedShape | None = None) -> StepInputs:
        """Flatten the scheduled tokens into the step's device inputs (host work only), in
        the batch order the metadata chose. ``fixed`` pads a decode-only batch to a bucket's
        shapes (see ``FixedShape``). Logit rows follow the order of ``out.scheduled``."""
        scheduled = out.scheduled
        layout = build_attention_metadata(
            [s.num_new_tokens for s in scheduled],
            [s.num_computed_tokens + s.num_new_tokens for s in scheduled],
            [s.block_ids for s in scheduled],
            self.block_size,
            self.device,
            fixed,
            contexts=self.decode_contexts if fixed is None else None,
            seq_keys=[s.key for s in scheduled],
        )
        ids: list[int] = []
        last_row: dict[int, int] = {}
        for i in layout.order:
            ids.extend(scheduled[i].token_ids)
            last_row[i] = len(ids) - 1
        logit_rows = [last_row[i] for i, s in enumerate(scheduled) if s.samples]
        num_samples = len(logit_rows)
        if fixed is not None:
            if num_samples != len(scheduled):
                raise ValueError("a fixed-shape step needs every sequence to sample")
            ids.extend([0] * (fixed.num_seqs - len(ids)))
            logit_rows = list(range(fixed.num_seqs))  # the order is kept, padding follows
        host = torch.tensor(ids + logit_rows, dtype=torch.long).to(self.device, non_blocking=True)
        return StepInputs(
            host[: len(ids)], layout.positions, layout.attn, host[len(ids) :], num_samples
        )

    def forward_step(self, inputs: StepInputs) -> torch.Tensor | None:
        """The model over the step's tokens, then float32 logits ``[num_logit_rows, vocab]``
        (None when no row samples). Device work only: no host synchronisation, and every
        shape follows from the inputs' shapes. A step with KV loads queued also runs their
        per-layer hook (stream waits on CUDA): such a step is not one to capture."""
        before_layer = self.kv_loads.before_layer if self.kv_loads.pending else None
        hidden = self.model(
            inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache, before_layer
        )
        if inputs.logit_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logit_rows))

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Run over ``kv_cache`` from now on, with as many blocks as it has (a multi-model
        switch that lends the staging region to the KV cache, or takes it back). The caller
        must hold no block of the previous cache: its contents are not carried over."""
        self.settle_kv_loads()
        shape = self.model.kv_cache_shape(kv_cache.shape[2], self.block_size)
        if tuple(kv_cache.shape) != shape:
            raise ValueError(f"KV cache has shape {tuple(kv_cache.shape)}, expected {shape}")
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[2]
        if self.decode_graphs is not None:
            self.decode_graphs.clear()

    def execute(
        self, out: SchedulerOutput, generators: dict[str, torch.Generator]
    ) -> list[SampledToken]:
        """Run the step's forward pass; sample one token per sequence that reached its end."""
        try:
            return self._execute(out, generators)
        finally:
            self.settle_kv_loads()

    def queue_kv_load(self, host_blocks: list[torch.Tensor], block_ids: list[int]) -> int:
        """Restore host block payloads into ``block_ids`` within the next forward pass (see
        the module doc); returns the bytes queued."""
        return self.kv_loads.add(self.kv_cache, host_blocks, block_ids)

    def settle_kv_loads(self) -> None:
        """Write any queued KV load now and keep its record for ``take_kv_load_records``."""
        record = self.kv_loads.finish()
        if record is not None:
            self._kv_load_records.append(record)

    def take_kv_load_records(self) -> list[MoveRecord]:
        """Records of the KV loads settled since the last call."""
        records, self._kv_load_records = self._kv_load_records, []
        return records

    def _execute(
        self, out: SchedulerOutput, generators: dict[str, torch.Generator]
    ) -> list[SampledToken]:
        if out.is_empty:
            return []
        graphs = self.decode_graphs
        shape = graphs.bucket(out) if graphs is not None and not self.kv_loads.pending else None
        inputs = self.prepare(out, shape)
        sampling = [s for s in out.scheduled if s.samples]
        with torch.inference_mode():
            if graphs is not None and shape is not None:
                logits = graphs.run(shape, inputs)
            else:
                logits = self.forward_step(inputs)
            if logits is None:
                return []
            result = self.sampler(
                logits[: inputs.num_samples],
                [s.request.params for s in sampling],
                [generators.get(s.request_id) for s in sampling],
                forced_tokens([s.request.thinking for s in sampling]),
            )
        return [
            SampledToken(s.request_id, tok, lp)
            for s, tok, lp in zip(sampling, result.token_ids, result.logprobs, strict=True)
        ]


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
