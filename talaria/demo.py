"""`talaria demo --library`: generate from the tiny models with the engine used as a library
(`talaria demo` without it is the agent session on the real model: ``demo_agent.py``)."""

from __future__ import annotations

import time

from engine import LLM, SamplingParams
from talaria.paths import ensure_tiny_models

DEMO_PROMPTS = [
    "def fibonacci(n):",
    "The agent read the failing test and",
    "Tool result: 3 files changed.",
    "<|im_start|>user\nFix the bug in parse_args<|im_end|>\n<|im_start|>assistant\n",
]


def run_demo(size: str = "tiny", max_tokens: int = 24) -> None:
    """Write the tiny models if missing, then generate greedily from each of them.

    The weights are random, so the text is noise; what the demo shows is the engine's
    pipeline end to end (tokenize, paged prefill, continuous batching, decode, detokenize)
    and its accounting: an agent-like session whose every turn re-sends the previous
    prompt, output and a tool result is served mostly from the prefix cache.
    """
    models = ensure_tiny_models(size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for name, path in models.items():
        llm = LLM(str(path))
        try:
            start = time.perf_counter()
            outputs = llm.generate(DEMO_PROMPTS, params)
            seconds = time.perf_counter() - start
            session = _session_turns(llm, outputs[0].prompt_token_ids, params, turns=3)
        finally:
            llm.shutdown()
        generated = sum(o.num_generated_tokens for o in outputs)
        print(f"== {name} ({path})")
        for out in outputs:
            print(
                f"  prompt={out.num_prompt_tokens:3d} tok cached={out.num_cached_tokens:3d} "
                f"generated={out.num_generated_tokens:3d} finish={out.finish_reason.value:6s} "
                f"text={out.text[:48]!r}"
            )
        print(f"  {generated} tokens in {seconds:.2f} s ({generated / seconds:.1f} tok/s)")
        for turn, (prompt_len, cached) in enumerate(session, start=1):
            print(f"  session turn {turn}: prompt={prompt_len:3d} tok, {cached:3d} from cache")


def _session_turns(
    llm: LLM, prompt: list[int], params: SamplingParams, turns: int
) -> list[tuple[int, int]]:
    """Each turn's prompt is the last prompt + its output + a tool result."""
    tool_result = llm.tokenizer.encode("\nTool result: ok\n")
    counts = []
    for _ in range(turns):
        out = llm.generate([prompt], params)[0]
        counts.append((out.num_prompt_tokens, out.num_cached_tokens))
        prompt = prompt + out.token_ids + tool_result
    return counts
