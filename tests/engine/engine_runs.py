"""Helpers for tests that drive engines (single-model cores and multi-model engines) to
completion and compare their outputs."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import EngineConfig, EngineCore
from engine.interface import EngineCoreProtocol, EngineRequest
from engine.sampling_params import SamplingParams

Outputs = dict[str, tuple[list[int], list[float]]]


def prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    """``n`` seeded token ids above the special tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def run(engine: EngineCoreProtocol, reqs: list[EngineRequest]) -> tuple[Outputs, int]:
    """Run requests to completion: rid -> (tokens, logprobs), and prefill tokens counted."""
    for r in reqs:
        engine.add_request(r)
    out: Outputs = {r.request_id: ([], []) for r in reqs}
    prefilled = 0
    while engine.has_unfinished():
        step = engine.step()
        prefilled += step.num_prefill_tokens
        for ev in step.events:
            out[ev.request_id][0].extend(ev.new_token_ids)
            out[ev.request_id][1].extend(ev.logprobs or [])
    return out, prefilled


def requests(
    model: str, tag: str, prompts: list[list[int]], params: SamplingParams
) -> list[EngineRequest]:
    """One request per prompt, each in its own session."""
    return [
        EngineRequest(f"{tag}-{i}", p, params, model=model, session_id=f"{tag}-s{i}")
        for i, p in enumerate(prompts)
    ]


def fresh(path: Path, reqs: list[EngineRequest], block_size: int, num_blocks: int) -> Outputs:
    """The same requests on a fresh single-model engine (the reference)."""
    core = EngineCore(
        EngineConfig(model=path, device="cpu", block_size=block_size, num_kv_blocks=num_blocks)
    )
    return run(core, reqs)[0]


def hf_greedy(path: Path, prompt_list: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (stops at EOS like the engine)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompt_list:
            ids = torch.tensor([p])
            g = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(g[0, ids.shape[1] :].tolist())
    return out


def assert_same(got: Outputs, want: Outputs, atol: float) -> None:
    """Same tokens; logprobs within ``atol``."""
    assert [v[0] for v in got.values()] == [v[0] for v in want.values()]
    for (_, lp_got), (_, lp_want) in zip(got.values(), want.values(), strict=True):
        torch.testing.assert_close(torch.tensor(lp_got), torch.tensor(lp_want), atol=atol, rtol=0)
