"""A replay prompt is a view of a list that only grows: it reads as the list it views, and
a continuation grows the list instead of copying it, never changing an earlier prompt."""

from __future__ import annotations

import random

import orjson
import pytest

from workloads.replay.prompts import PromptView, SessionTokens, next_prompt


def _reference(prev: list[int], out: list[int], input_tokens: int, tokens: SessionTokens,
               keep: int | None) -> list[int]:
    """The definition: the first ``input_tokens`` of prompt + output (its first ``keep``),
    then fresh tokens."""
    base = (prev + out)[: len(prev) + len(out) if keep is None else keep]
    base = base[:input_tokens]
    return base + tokens.take(input_tokens - len(base))


def test_a_view_reads_as_the_list_it_views() -> None:
    backing = [5, 6, 7, 8, 9, 10]
    view, same = PromptView(backing, 4), [5, 6, 7, 8]
    assert len(view) == 4 and list(view) == same and view == same and same == view
    assert view == tuple(same) and view == PromptView([5, 6, 7, 8, 1], 4)
    assert view != [5, 6, 7] and view != [5, 6, 7, 9] and view != PromptView(backing, 3)
    for index in range(-4, 4):
        assert view[index] == same[index]
    for bad in (4, -5):
        with pytest.raises(IndexError):
            view[bad]
    for cut in (slice(None), slice(1, 3), slice(2, None), slice(-2, None), slice(None, 10),
                slice(None, None, 2), slice(None, None, -1), slice(3, 1, -1)):
        assert view[cut] == same[cut] and type(view[cut]) is list
    assert view + [1, 2] == same + [1, 2] and type(view + [1]) is list
    assert not PromptView(backing, 0) and view and 8 in view and 9 not in view
    with pytest.raises(TypeError):
        hash(view)
    with pytest.raises(ValueError):
        PromptView(backing, 7)


@pytest.mark.parametrize("seed", range(40))
def test_next_prompt_is_the_definition_whichever_path_it_takes(seed: int) -> None:
    rng = random.Random(seed)
    ours, theirs = SessionTokens("s", seed, 50_000), SessionTokens("s", seed, 50_000)
    prompt: list[int] | PromptView = PromptView(ours.take(30), 30)
    expected = list(prompt)
    theirs.take(30)
    for _ in range(12):
        out = [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 20))]
        base = len(expected) + len(out)
        input_tokens = max(1, base + rng.randrange(-25, 40))
        keep = None if rng.random() < 0.6 else rng.randrange(1, base + 5)
        earlier, earlier_tokens = prompt, list(prompt)
        prompt = next_prompt(prompt, out, input_tokens, ours, keep)
        expected = _reference(expected, out, input_tokens, theirs, keep)
        assert prompt == expected and len(prompt) == input_tokens
        assert earlier == earlier_tokens  # an earlier prompt never changes


def test_a_continuation_grows_the_list_and_a_compaction_copies() -> None:
    tokens = SessionTokens("s", 0, 1000)
    first = PromptView(tokens.take(10), 10)
    second = next_prompt(first, [1, 2, 3], 20, tokens)
    assert second._tokens is first._tokens and first.at_end is False and second.at_end
    assert second[:13] == list(first) + [1, 2, 3]
    # a second continuation of the first prompt (not at the end of its list any more) and a
    # compaction of the second each get a list of their own
    again = next_prompt(first, [4], 12, tokens)
    shorter = next_prompt(second, [7], 15, tokens, keep=8)
    assert again._tokens is not first._tokens and again[:11] == list(first) + [4]
    assert shorter._tokens is not second._tokens and shorter[:8] == second[:8]
    assert len(second) == 20 and second[10:13] == [1, 2, 3]  # unchanged by either


def test_a_call_with_a_view_prompt_is_sent_as_a_list() -> None:
    from engine.sampling_params import SamplingParams
    from talaria.protocol import CallRequest

    call = CallRequest("c", "s", "m", PromptView([3, 4, 5, 6], 3), SamplingParams(max_tokens=2))
    data = call.to_dict()
    assert data["prompt_token_ids"] == [3, 4, 5] and type(data["prompt_token_ids"]) is list
    assert CallRequest.from_dict(orjson.loads(orjson.dumps(data))).prompt_token_ids == [3, 4, 5]
