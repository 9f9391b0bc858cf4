"""Sampler: greedy, seeded reproducibility independent of the batch, top-k / top-p, logprobs."""

from __future__ import annotations

import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

V = 50


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=gen(seed))


def test_greedy_is_argmax() -> None:
    x = logits(4)
    out = Sampler()(x, [SamplingParams(temperature=0.0)] * 4)
    assert out.token_ids == x.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_seeded_request_independent_of_batch() -> None:
    row = logits(1, seed=3)
    p = SamplingParams(temperature=1.0, seed=42)
    seq_alone = []
    g = gen(42)
    for _ in range(20):
        seq_alone.append(Sampler(gen(0))(row, [p], [g]).token_ids[0])
    # Same request in a batch with other (seeded and unseeded) rows, in a different slot.
    others = logits(3, seed=9)
    g = gen(42)
    seq_batch = []
    for i in range(20):
        batch = torch.cat([others[:2], row, others[2:]])
        params = [SamplingParams(temperature=0.7), SamplingParams(seed=5), p, SamplingParams()]
        gens = [None, gen(i), g, None]
        seq_batch.append(Sampler(gen(100 + i))(batch, params, gens).token_ids[2])
    assert seq_alone == seq_batch
    assert len(set(seq_alone)) > 1  # it really samples


def test_top_k_one_is_greedy_and_top_k_limits_support() -> None:
    x = logits(2, seed=1)
    out = Sampler(gen(0))(x, [SamplingParams(top_k=1)] * 2)
    assert out.token_ids == x.argmax(-1).tolist()
    top3 = set(x[0].topk(3).indices.tolist())
    s = Sampler(gen(1))
    seen = {s(x[:1], [SamplingParams(top_k=3, temperature=2.0)]).token_ids[0] for _ in range(200)}
    assert seen <= top3 and len(seen) == 3


def test_top_p_keeps_smallest_nucleus() -> None:
    x = torch.full((1, V), -10.0)
    x[0, 5] = 3.0  # p ~ 0.7
    x[0, 9] = 2.0  # p ~ 0.26
    x[0, 11] = 0.0
    s = Sampler(gen(2))
    seen = {s(x, [SamplingParams(top_p=0.8)]).token_ids[0] for _ in range(300)}
    assert seen == {5, 9}
    seen = {s(x, [SamplingParams(top_p=0.5)]).token_ids[0] for _ in range(50)}
    assert seen == {5}


def test_temperature_changes_spread() -> None:
    x = logits(1, seed=4)
    s = Sampler(gen(3))
    cold = {s(x, [SamplingParams(temperature=0.01)]).token_ids[0] for _ in range(50)}
    assert cold == {int(x.argmax())}


def test_logprobs_of_sampled_tokens() -> None:
    x = logits(3, seed=6)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1, logprobs=True),
    ]
    out = Sampler(gen(0))(x, params, [None, None, gen(1)])
    lp = torch.log_softmax(x, -1)
    assert out.logprobs[1] is None
    for i in (0, 2):
        assert abs(out.logprobs[i] - float(lp[i, out.token_ids[i]])) < 1e-5


def test_top_p_stops_at_the_first_token_reaching_p() -> None:
    # HF's TopPLogitsWarper and vLLM keep the smallest set whose probability reaches top_p:
    # of four equal tokens at top_p=0.5, two; of [0.5, 0.25, 0.25], the first alone.
    s = Sampler(gen(4))
    uniform = torch.zeros(1, 4)
    seen = {s(uniform, [SamplingParams(top_p=0.5)]).token_ids[0] for _ in range(200)}
    assert len(seen) == 2
    half = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    seen = {s(half, [SamplingParams(top_p=0.5)]).token_ids[0] for _ in range(100)}
    assert seen == {0}


def test_a_top_p_below_float32s_smallest_keeps_the_most_likely_token() -> None:
    # top_p=1e-50 passes the (0, 1] check but is 0.0 as a float32 tensor: the cut must still
    # keep the first sorted token, not mask every one (NaN probabilities, token 0 each time).
    x = logits(4, seed=8)
    out = Sampler(gen(8))(x, [SamplingParams(top_p=1e-50)] * 4)
    assert out.token_ids == x.argmax(-1).tolist()
    assert not bool(Sampler._filtered_probs(x, [SamplingParams(top_p=1e-50)] * 4).isnan().any())


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    # HF's TopKLogitsWarper and vLLM mask only logits below the k-th largest: a tie at the
    # boundary stays in (common with bfloat16 logits), whichever order the sort put it in.
    x = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.5]])
    s = Sampler(gen(5))
    seen = {s(x, [SamplingParams(top_k=2)]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1, 2}


def test_top_p_of_one_filters_nothing_beside_a_row_that_filters() -> None:
    # A row with top_p=1.0 sorted and cut beside a top_p<1 row: float32 rounding lifts the
    # running sum past 1.0 before the tail, which must not cost the tail its probability.
    x = torch.randn(2, 50_000, generator=gen(7)) * 3
    both = Sampler._filtered_probs(x, [SamplingParams(top_p=0.5), SamplingParams(top_p=1.0)])
    alone = Sampler._filtered_probs(x[1:], [SamplingParams(top_p=1.0)])
    assert bool((both[1] > 0).all())
    torch.testing.assert_close(both[1], alone[0])


def test_an_exponential_draw_of_zero_never_picks_a_filtered_token(monkeypatch) -> None:
    """torch's CPU ``exponential_`` can return exactly 0 (pytorch#166243): a filtered token
    (probability 0) over a zero draw is 0/0 = NaN, which ``argmax`` takes as the largest.
    Every draw is 0 here: the sampler must still pick a token top-k / top-p keep."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, generator=None: self.zero_())
    x = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 9.0, 1.0]])
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.5, seed=1)]
    out = Sampler(gen(0))(x, params, [None, gen(1)])
    assert out.token_ids == [1, 2]


def test_a_forced_row_takes_its_token_with_the_models_logprob_and_draws_nothing() -> None:
    """A thinking budget's forced token: the row takes it, its logprob is the raw
    distribution's for it, the other rows sample as without it, and the forced row's own
    generator is left as it was."""
    x = logits(3, seed=4)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(seed=7, logprobs=True),
              SamplingParams(seed=8, logprobs=True)]
    forced_gen, free_gen = gen(7), gen(8)
    out = Sampler(gen(0))(x, params, [None, forced_gen, free_gen], [None, 11, None])
    plain = Sampler(gen(0))(x, params, [None, gen(7), gen(8)])
    assert out.token_ids[1] == 11 and plain.token_ids[1] != 11
    assert out.logprobs[1] == torch.log_softmax(x[1], -1)[11].item()
    assert [out.token_ids[i] for i in (0, 2)] == [plain.token_ids[i] for i in (0, 2)]
    assert [out.logprobs[i] for i in (0, 2)] == [plain.logprobs[i] for i in (0, 2)]
    assert forced_gen.get_state().equal(gen(7).get_state())
    assert not free_gen.get_state().equal(gen(8).get_state())
