"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Sampling draws ``argmax(p / q)`` with ``q ~ Exp(1)`` (equivalent to drawing from ``p``; a draw
of exactly 0, which torch's CPU generator can return, counts as the smallest positive float).
A request with its own generator draws its ``q`` row alone from that generator, so its
tokens depend only on its seed and its logits, never on what else is in the batch.
Requests without a generator share the sampler's generator. Logprobs are those of the
model's distribution (raw logits, before temperature / top-k / top-p). A row given a forced
token (a thinking budget's end, ``engine.thinking_budget``) takes it without drawing; its
logprob is the model's for that token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        forced: list[int | None] | None = None,
    ) -> SamplerOutput:
        """One token per row; ``forced[i]`` (when given and not None) is row i's token."""
        n, vocab = logits.shape
        if len(params) != n:
            raise ValueError(f"{n} rows of logits but {len(params)} sampling params")
        generators = generators if generators is not None else [None] * n
        logits = logits.float()
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)

        free: Sequence[int] = range(n)
        if forced is not None:  # the common step has none: no pass over the rows for them
            taken = [i for i, t in enumerate(forced) if t is not None]
            if taken:
                tokens[taken] = torch.tensor([forced[i] for i in taken], device=logits.device)
                free = [i for i, t in enumerate(forced) if t is None]

        greedy = [i for i in free if params[i].greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)

        rand = [i for i in free if not params[i].greedy]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            probs = self._filtered_probs(logits[idx], [params[i] for i in rand])
            q = torch.empty_like(probs)
            shared = [j for j, i in enumerate(rand) if generators[i] is None]
            if shared:
                q[shared] = torch.empty(len(shared), vocab, device=probs.device).exponential_(
                    generator=self.generator
                )
            for j, i in enumerate(rand):
                gen = generators[i]
                if gen is not None:
                    q[j] = torch.empty(vocab, device=probs.device).exponential_(generator=gen)
            # a draw of exactly 0 (possible on a CPU) would make a filtered token 0/0 = NaN,
            # which argmax takes as the largest: the smallest positive float keeps it at 0
            q.clamp_(min=torch.finfo(q.dtype).tiny)
            tokens[idx] = (probs / q).argmax(dim=-1)

        token_list = tokens.tolist()
        logprobs: list[float | None] = [None] * n
        want = [i for i, p in enumerate(params) if p.logprobs]
        if want:
            idx = torch.tensor(want, device=logits.device)
            lp = torch.log_softmax(logits[idx], dim=-1)
            picked = lp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
            for i, v in zip(want, picked, strict=True):
                logprobs[i] = v
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Softmax of temperature-scaled logits with top-k / top-p applied per row."""
        device = logits.device
        vocab = logits.shape[1]
        temps = torch.tensor([p.temperature for p in params], device=device)
        x = logits / temps.unsqueeze(1)
        use_k = any(0 < p.top_k < vocab for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        if use_k or use_p:
            sorted_x, order = x.sort(dim=-1, descending=True)
            if use_k:
                k = torch.tensor(
                    [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device
                )
                kth = sorted_x.gather(1, (k - 1).unsqueeze(1))  # ties with it stay in
                sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
            if use_p:
                # 1.0 cuts nothing: the float32 running sum may pass 1.0 before the tail ends
                top_p = torch.tensor(
                    [p.top_p if p.top_p < 1.0 else math.inf for p in params], device=device
                )
                sp = torch.softmax(sorted_x, dim=-1)
                before = sp.cumsum(dim=-1) - sp  # a token is kept while those before it miss p
                cut = before >= top_p.unsqueeze(1)
                cut[:, 0] = False  # a top_p under float32's smallest is 0.0 here: keep the top
                sorted_x = sorted_x.masked_fill(cut, float("-inf"))
            x = torch.empty_like(x).scatter_(-1, order, sorted_x)
        return torch.softmax(x, dim=-1)
