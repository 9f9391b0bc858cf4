"""A thinking budget on the engine (``engine.thinking_budget``), on a tiny random-weight model
at temperature 0: once the answer has thought N tokens, the end ids are forced at exactly
position N of its thinking, and then the model goes on as it would from that text; with no
budget, one never reached, or a thinking the model ends itself first, the output is the
engine's output without the field. The tokens chosen as start and end ids are ordinary ids
of the vocabulary, picked from the answer without a budget (the model "writes" them)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from engine_runs import prompt

from engine import EngineConfig, EngineCore, SamplingParams
from engine.interface import EngineRequest
from engine.models.tiny import build_tokenizer, write_random_checkpoint

VOCAB = 512
MAX = 16
PROMPT = prompt(1, 9)
OTHER = prompt(2, 13)
_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("think") / "llama", "llama", seed=1,
                                   tokenizer=build_tokenizer(VOCAB))


@pytest.fixture(scope="module")
def core(model: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", block_size=4, num_kv_blocks=64,
                                   max_model_len=128))


def params(max_tokens: int = MAX, **thinking: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True,
                          **thinking)  # type: ignore[arg-type]


def generate(core: EngineCore, *calls: tuple[list[int], SamplingParams]) -> list[list[int]]:
    """The calls' output tokens, run together in one batch."""
    rids = [f"t{next(_ids)}" for _ in calls]
    for rid, (ids, p) in zip(rids, calls, strict=True):
        core.add_request(EngineRequest(rid, ids, p))
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    while core.has_unfinished():
        for ev in core.step().events:
            out[ev.request_id].extend(ev.new_token_ids)
    return [out[rid] for rid in rids]


def unused(tokens: list[int], n: int) -> list[int]:
    """``n`` ids above the special tokens that ``tokens`` never holds."""
    return [t for t in range(3, VOCAB) if t not in tokens][:n]


def first_new(tokens: list[int], start: int) -> int:
    """The first position from ``start`` whose token is not among those before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def base(core: EngineCore) -> list[int]:
    """The answer without a thinking budget."""
    (out,) = generate(core, (PROMPT, params()))
    assert len(set(out[:6])) == 6, f"the model's answer repeats itself, pick another prompt: {out}"
    return out


@pytest.mark.parametrize("budget", [0, 3])
@pytest.mark.parametrize("n_end", [1, 2])
def test_the_end_is_forced_at_the_budget_and_the_model_goes_on_from_there(
        core: EngineCore, base: list[int], budget: int, n_end: int) -> None:
    end = unused(base, n_end)
    (out,) = generate(core, (PROMPT, params(thinking_budget=budget, thinking_end_ids=end,
                                            thinking_from_start=True)))
    closed = budget + n_end
    assert out[:budget] == base[:budget]
    assert out[budget:closed] == end
    assert len(out) == MAX
    (after,) = generate(core, (PROMPT + out[:closed], params(MAX - closed)))
    assert out[closed:] == after  # sampled as from that text: nothing more is forced


@pytest.mark.parametrize("n_start", [1, 2])
def test_thinking_starts_after_the_start_ids(core: EngineCore, base: list[int], n_start: int) -> None:
    end = unused(base, 1)  # the answer opens with base[:n_start]: the thinking opens after it
    thinking = {"thinking_start_ids": base[:n_start], "thinking_end_ids": end}
    (out,) = generate(core, (PROMPT, params(thinking_budget=2, **thinking)))
    assert out[:n_start + 2] == base[:n_start + 2]
    assert out[n_start + 2] == end[0]
    never = {"thinking_start_ids": unused(base, 2)[1:], "thinking_end_ids": end}
    assert generate(core, (PROMPT, params(thinking_budget=0, **never))) == [base]


def test_start_ids_written_after_the_answer_began_open_no_thinking(core: EngineCore, base: list[int]) -> None:
    """The router reads an answer that does not open with ``<think>`` as all content
    (``router.api.reasoning``, qwen3): start ids the model writes later open no thinking, so
    no end is forced into that content."""
    end = unused(base, 1)
    for start in ([base[1]], [base[2], base[3]], [base[0], base[2]]):
        later = {"thinking_start_ids": start, "thinking_end_ids": end}
        assert generate(core, (PROMPT, params(thinking_budget=0, **later))) == [base], start


def test_without_a_budget_or_short_of_it_nothing_changes(core: EngineCore, base: list[int]) -> None:
    end = unused(base, 1)
    ids_only = params(thinking_end_ids=end, thinking_start_ids=end, thinking_from_start=True)
    not_reached = params(thinking_budget=MAX, thinking_end_ids=end, thinking_from_start=True)
    assert generate(core, (PROMPT, ids_only)) == [base]
    assert generate(core, (PROMPT, not_reached)) == [base]


@pytest.mark.parametrize("n_end", [1, 2])
def test_a_thinking_the_model_ends_itself_is_never_cut(core: EngineCore, base: list[int], n_end: int) -> None:
    """The model writes the end ids at ``ends``, before a budget of ``ends + 3``: the answer is
    as without a budget, and no end is forced later, when the count would have run out."""
    ends = first_new(base, 2)
    end = base[ends:ends + n_end]
    (out,) = generate(core, (PROMPT, params(thinking_budget=ends + 3, thinking_end_ids=end,
                                            thinking_from_start=True)))
    assert out == base
    assert base[ends + 3] != end[0]  # a count that went on would have forced it there
    (cut,) = generate(core, (PROMPT, params(thinking_budget=ends - 1, thinking_end_ids=end,
                                            thinking_from_start=True)))
    assert cut[ends - 1:ends - 1 + n_end] == end  # the same budget spent before: forced


def test_a_budget_spent_inside_a_partly_written_end_forces_only_its_rest(
        core: EngineCore, base: list[int]) -> None:
    """The model writes the end's first token itself at ``k`` and the budget runs out on it:
    the end's second token is forced next, not the whole end again after its beginning."""
    k = first_new(base, 2)
    end = [base[k], *unused(base, 1)]
    (out,) = generate(core, (PROMPT, params(thinking_budget=k + 1, thinking_end_ids=end,
                                            thinking_from_start=True)))
    assert out[:k + 1] == base[:k + 1]
    assert out[k + 1] == end[1]
    (after,) = generate(core, (PROMPT + out[:k + 2], params(MAX - k - 2)))
    assert out[k + 2:] == after  # the thinking ended there: nothing more is forced


def test_in_a_batch_only_the_request_with_a_budget_is_forced(core: EngineCore, base: list[int]) -> None:
    end = unused(base, 2)
    budgeted = params(thinking_budget=2, thinking_end_ids=end, thinking_from_start=True)
    (alone,) = generate(core, (PROMPT, budgeted))
    (other,) = generate(core, (OTHER, params()))
    assert generate(core, (OTHER, params()), (PROMPT, budgeted), (PROMPT, params())) == [other, alone, base]


def test_the_count_survives_a_preemption(model: Path, base: list[int]) -> None:
    """Recomputed after a preemption, the requests keep their thinking counts: the outputs
    are those of a roomy engine, ends forced where they were."""
    end = unused(base, 2)
    tight = EngineCore(EngineConfig(model=model, device="cpu", block_size=4, num_kv_blocks=9,
                                    max_model_len=128, max_num_batched_tokens=64))
    roomy = EngineCore(EngineConfig(model=model, device="cpu", block_size=4, num_kv_blocks=64,
                                    max_model_len=128, max_num_batched_tokens=64))
    calls = [(prompt(10 + i, 7), params(thinking_budget=4 + i, thinking_end_ids=end, thinking_from_start=True))
             for i in range(3)]
    got = generate(tight, *calls)
    assert tight.stats().extra["num_preemptions"] > 0
    assert got == generate(roomy, *calls)
    assert all(out[4 + i:6 + i] == end for i, out in enumerate(got))


def test_end_ids_outside_the_vocabulary_are_refused(core: EngineCore) -> None:
    bad = params(thinking_budget=1, thinking_end_ids=[3, VOCAB], thinking_from_start=True)
    with pytest.raises(ValueError, match="thinking_end_ids holds 512"):
        core.add_request(EngineRequest("out-of-vocab", PROMPT, bad))
    assert not core.has_unfinished()


def test_decode_steps_in_fixed_shape_buckets_force_alike(model: Path, base: list[int]) -> None:
    """The decode-graph path (run eagerly on a CPU) samples after the bucket's forward: the
    same forced ends, the same outputs."""
    end = unused(base, 2)
    calls = [(PROMPT, params(thinking_budget=3, thinking_end_ids=end, thinking_from_start=True)),
             (OTHER, params())]
    plain = EngineCore(EngineConfig(model=model, device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128))
    bucketed = EngineCore(EngineConfig(model=model, device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128))
    graphs = bucketed.runner.use_decode_graphs(4, 32)
    got = generate(bucketed, *calls)
    assert len(graphs) > 0
    assert got == generate(plain, *calls) and got[0][3:5] == end
