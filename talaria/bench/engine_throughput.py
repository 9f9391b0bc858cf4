"""Engine throughput against transformers' ``generate`` on the same model and prompts.

Three runs of the same work (``num_requests`` prompts of ~``prompt_len`` tokens, exactly
``output_len`` generated tokens each, greedy): transformers one request at a time,
transformers as one left-padded batch, and the engine (continuous batching, paged KV).
Ratios are taken within one run so machine noise affects all three alike.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class ThroughputResult:
    name: str
    seconds: float
    generated_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def make_prompts(
    vocab_size: int, num_requests: int, prompt_len: int, seed: int = 0
) -> list[list[int]]:
    """Random token prompts of prompt_len +- 10% (ids above the special tokens)."""
    rng = random.Random(seed)
    low = max(3, int(prompt_len * 0.9))
    high = int(prompt_len * 1.1)
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randint(low, high))]
        for _ in range(num_requests)
    ]


def run_engine(model_dir: Path, prompts: list[list[int]], output_len: int) -> ThroughputResult:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=len(prompts))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return ThroughputResult("engine", seconds, sum(o.num_generated_tokens for o in outputs))


def _hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def run_hf_sequential(
    model_dir: Path, prompts: list[list[int]], output_len: int
) -> ThroughputResult:
    model = _hf_model(model_dir)
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            generated += out.shape[1] - ids.shape[1]
    return ThroughputResult("transformers (one at a time)", time.perf_counter() - start, generated)


def run_hf_batched(model_dir: Path, prompts: list[list[int]], output_len: int) -> ThroughputResult:
    model = _hf_model(model_dir)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as generation requires
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
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
    return ThroughputResult("transformers (padded batch)", time.perf_counter() - start, generated)


def bench_engine_throughput(
    model_dir: Path, num_requests: int = 32, prompt_len: int = 256, output_len: int = 64
) -> list[ThroughputResult]:
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, num_requests, prompt_len)
    return [
        run_hf_sequential(model_dir, prompts, output_len),
        run_hf_batched(model_dir, prompts, output_len),
        run_engine(model_dir, prompts, output_len),
    ]
