"""Where a stop string ends an answer, in its tokens as well as in its text.

The invariant: an answer that a stop string ends keeps the tokens up to and including the
one whose text completed the stop string, and no token after it, however the instance
grouped the tokens into events. Its logprobs (collected, and each streamed chunk's) are
those tokens' logprobs: a token that came in the same event after the completing one gives
none, though its text was decoded with the rest.

A token straddling the stop string counts by where the stop string completes: the token
whose text holds the stop string's last character is kept (whether its text starts before
the stop string, inside it, or runs on past its end), as is every token before it, those
wholly inside the stop string included; their text past the cut is not returned. This is
what vLLM returns: without speculative decoding it adds one token a step and checks the
stop strings after each, so its ``token_ids`` and ``logprobs`` end with the token that
completed the stop string while its text is cut before it; where a step gave several tokens,
its V0 engine appended them one at a time and stopped at that token, dropping the step's
tokens after it (``MultiStepOutputProcessor._process_seq_outputs`` in
``vllm/engine/output_processor/multi_step.py``). Its V1 engine checks a speculative step's
tokens together and leaves those past the stop string in ``token_ids`` and ``logprobs``, a
bug that vllm-project/vllm#47616 (open) trims.

So the tokens of an event are decoded and matched one at a time once there are stop strings:
the text cut then does not depend on the grouping either (with two stop strings, one
starting earlier but ending later, the one completed first wins, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from talaria.protocol.text import IncrementalDetokenizer, StopMatcher


@dataclass
class StopCut:
    """What an event's tokens added: the text safe to send, whether a stop string ended the
    answer, and how many of the event's tokens the answer keeps."""

    text: str
    stopped: bool
    kept: int


def feed_tokens(
    detok: IncrementalDetokenizer, stop: StopMatcher, token_ids: Sequence[int], finished: bool,
    one_by_one: bool,
) -> StopCut:
    """Decode ``token_ids`` and match the stop strings in their text (``finished``: the
    last event, whose held-back bytes are flushed). ``one_by_one``: there are stop strings,
    so each token is matched after its own text; else the event's tokens are decoded
    together (the same text) and all kept."""
    groups = [token_ids[k:k + 1] for k in range(len(token_ids))] if one_by_one else []
    groups = groups or [token_ids]  # together (an event without tokens may still finish)
    texts: list[str] = []
    kept = 0
    for k, group in enumerate(groups):
        text = detok.push(group)
        if finished and k == len(groups) - 1:
            text += detok.flush()  # bytes that never completed a character
        emit, stopped = stop.feed(text)
        texts.append(emit)
        kept += len(group)
        if stopped:
            return StopCut("".join(texts), True, kept)
    return StopCut("".join(texts), False, kept)
