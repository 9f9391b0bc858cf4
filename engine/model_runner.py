"""Runs one scheduled step on the model: KV tensors, input preparation, forward, sampling.

The KV cache is one (k, v) pair per layer, each ``[num_blocks, block_size, kv_heads,
head_dim]``. The runner allocates it, or takes caller-supplied tensors (e.g. views of a
device arena) that it never reallocates. Logits are computed only for the last scheduled
token of sequences that reach their end this step (the ones that yield a token).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.parallel_context import SINGLE, ParallelContext
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

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
        kv_caches: KVCaches | None = None,
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
        num_layers, kv_heads, head_dim = model.kv_cache_spec()
        shape = (num_blocks, block_size, kv_heads, head_dim)
        if kv_caches is None:
            kv_caches = [
                (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                for _ in range(num_layers)
            ]
        if len(kv_caches) != num_layers:
            raise ValueError(f"model has {num_layers} layers, got {len(kv_caches)} KV caches")
        for i, (k, v) in enumerate(kv_caches):
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(
                    f"KV cache of layer {i} has shapes {tuple(k.shape)}/{tuple(v.shape)}, "
                    f"expected {shape}"
                )
        self.kv_caches = kv_caches
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.sampler = Sampler(gen)

    # ----------------------------------------------------------------- building
    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        kv_caches: KVCaches | None = None,
        parallel: ParallelContext = SINGLE,
    ) -> ModelRunner:
        """Build the model from ``config.model`` (HF directory), load weights, size the KV."""
        from transformers import AutoConfig

        from engine.attention.selector import get_attention_backend
        from engine.loader import load_checkpoint
        from engine.models.registry import build_model

        path = Path(config.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
        hf_config = AutoConfig.from_pretrained(path)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, hf_config)
        backend = get_attention_backend(
            config.attention_backend, device=device, block_size=config.block_size
        )
        with torch.device(device):
            model = build_model(hf_config, dtype, parallel, backend)
        load_checkpoint(model, path)
        model.eval()
        if kv_caches is not None:
            num_blocks = kv_caches[0][0].shape[0]
        else:
            num_blocks = cls.choose_num_blocks(config, model, hf_config, dtype, device)
        return cls(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            vocab_size=int(hf_config.vocab_size),
            device=device,
            dtype=dtype,
            kv_caches=kv_caches,
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
    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled tokens into (input_ids, positions, metadata, logit rows)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        max_blocks = max(len(s.block_ids) for s in out.scheduled)
        table = torch.zeros((len(out.scheduled), max_blocks), dtype=torch.int32)
        offset = 0
        for i, s in enumerate(out.scheduled):
            start, n = s.num_computed_tokens, s.num_new_tokens
            ids.extend(s.token_ids)
            blocks = torch.tensor(s.block_ids, dtype=torch.long)
            table[i, : len(s.block_ids)] = blocks.to(torch.int32)
            pos = torch.arange(start, start + n, dtype=torch.long)
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(start + n)
            offset += n
            if s.samples:
                logit_rows.append(offset - 1)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        return input_ids, torch.cat(positions).to(dev, non_blocking=True), attn, logit_rows

    def execute(
        self, out: SchedulerOutput, generators: dict[str, torch.Generator]
    ) -> list[SampledToken]:
        """Run the step's forward pass; sample one token per sequence that reached its end."""
        if out.is_empty:
            return []
        input_ids, positions, attn, logit_rows = self.prepare(out)
        sampling = [s for s in out.scheduled if s.samples]
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, attn, self.kv_caches)
            if not sampling:
                return []
            rows = torch.tensor(logit_rows, dtype=torch.long, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            result = self.sampler(
                logits,
                [s.request.params for s in sampling],
                [generators.get(s.request_id) for s in sampling],
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
