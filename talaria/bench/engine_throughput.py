"""Engine throughput against transformers' ``generate`` on the same model and prompts.

Three runs of the same work (``num_requests`` prompts of mixed lengths drawn uniformly from
``[min_prompt_len, max_prompt_len]``, exactly ``output_len`` generated tokens each, greedy):
transformers one request at a time, transformers as one left-padded batch, and the engine
(continuous batching, paged KV). Ratios are taken within one run so machine noise affects
all three alike; the engine and the padded batch, which take seconds, run twice, interleaved,
and each keeps its faster run.

The engine run also measures its pure decode steps against the device's memory bandwidth:
each decode step must read every weight the step uses once and the KV of every running
sequence's context; the achieved fraction is (those bytes / step time) over the rate of a
large copy on the device (bytes read + written per second). Everything runs on ``device``
in ``dtype`` (fp32 on the CPU, bfloat16 on a GPU by default), both sides alike.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from substrate.mover import synchronize


@dataclass
class ThroughputResult:
    name: str
    seconds: float
    generated_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


@dataclass
class DecodeBandwidth:
    """The engine's pure decode steps against the machine's copy bandwidth."""

    steps: int
    seconds: float
    weight_bytes: int  # read once per step
    kv_bytes: int  # summed over the steps
    copy_bytes_per_s: float

    @property
    def achieved_bytes_per_s(self) -> float:
        return (self.steps * self.weight_bytes + self.kv_bytes) / self.seconds

    @property
    def fraction(self) -> float:
        return self.achieved_bytes_per_s / self.copy_bytes_per_s


@dataclass
class EngineBenchResult:
    runs: list[ThroughputResult]  # transformers one at a time, padded batch, engine
    decode: DecodeBandwidth


def make_prompts(
    vocab_size: int, num_requests: int, min_len: int, max_len: int, seed: int = 0
) -> list[list[int]]:
    """Random token prompts of uniformly drawn lengths (ids above the special tokens)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_requests)
    ]


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device: str = "cpu") -> float:
    """Best copy rate on ``device`` over ``repeats`` copies, counting bytes read plus
    written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(torch.device(device))
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(torch.device(device))
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters one step reads in full: all but an untied input embedding,
    of which a step reads only its tokens' rows."""
    embed = model.model.embed_tokens.weight  # type: ignore[union-attr]
    head = model.lm_head.weight  # type: ignore[union-attr]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if embed is not head:
        total -= embed.numel() * embed.element_size()
    return total


def run_engine(
    model_dir: Path, prompts: list[list[int]], output_len: int, device: str = "cpu",
    dtype: str = "float32",
) -> tuple[ThroughputResult, DecodeBandwidth]:
    from engine import LLM, SamplingParams
    from engine.interface import EngineRequest

    llm = LLM(str(model_dir), dtype=dtype, device=device, max_num_seqs=len(prompts))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        core = llm.engine
        runner = core.runner
        kv_per_token = runner.kv_bytes_per_block(runner.model, 1, runner.dtype)
        generated = decode_steps = decode_kv = 0
        decode_s = 0.0
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            core.add_request(EngineRequest(f"bench-{i}", prompt, params))
        while core.has_unfinished():
            context = sum(r.num_tokens for r in core.scheduler.running)
            result = core.step()
            generated += sum(len(ev.new_token_ids) for ev in result.events)
            if result.num_prefill_tokens == 0 and result.num_decode_tokens > 0:
                decode_steps += 1
                decode_s += result.seconds
                decode_kv += context * kv_per_token
        seconds = time.perf_counter() - start
        weights = step_weight_bytes(runner.model)
    finally:
        llm.shutdown()
    bandwidth = DecodeBandwidth(decode_steps, decode_s, weights, decode_kv,
                                copy_bandwidth(device=device))
    return ThroughputResult("engine", seconds, generated), bandwidth


def _hf_model(model_dir: Path, device: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.to(device).eval()


def run_hf_sequential(
    model_dir: Path, prompts: list[list[int]], output_len: int, device: str = "cpu",
    dtype: str = "float32",
) -> ThroughputResult:
    model = _hf_model(model_dir, device, dtype)
    generated = 0
    synchronize(torch.device(device))
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            generated += out.shape[1] - ids.shape[1]
    synchronize(torch.device(device))
    return ThroughputResult("transformers (one at a time)", time.perf_counter() - start, generated)


def run_hf_batched(
    model_dir: Path, prompts: list[list[int]], output_len: int, device: str = "cpu",
    dtype: str = "float32",
) -> ThroughputResult:
    model = _hf_model(model_dir, device, dtype)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as generation requires
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    synchronize(torch.device(device))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
    generated = (out.shape[1] - width) * len(prompts)
    synchronize(torch.device(device))
    return ThroughputResult("transformers (padded batch)", time.perf_counter() - start, generated)


def bench_engine_throughput(
    model_dir: Path,
    num_requests: int = 32,
    min_prompt_len: int = 64,
    max_prompt_len: int = 448,
    output_len: int = 64,
    repeats: int = 2,
    device: str = "cpu",
    dtype: str = "float32",
) -> EngineBenchResult:
    """The engine and transformers' padded batch run ``repeats`` times, interleaved, and the
    fastest run of each counts (a shared machine's load only slows runs down); transformers
    one request at a time runs once (its ratio is large and it takes longest)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, num_requests, min_prompt_len, max_prompt_len)
    engines: list[tuple[ThroughputResult, DecodeBandwidth]] = []
    batched: list[ThroughputResult] = []
    for _ in range(repeats):
        engines.append(run_engine(model_dir, prompts, output_len, device, dtype))
        batched.append(run_hf_batched(model_dir, prompts, output_len, device, dtype))
    engine, decode = min(engines, key=lambda r: r[0].seconds)
    runs = [
        run_hf_sequential(model_dir, prompts, output_len, device, dtype),
        min(batched, key=lambda r: r.seconds),
        engine,
    ]
    return EngineBenchResult(runs, decode)
