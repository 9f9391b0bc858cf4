"""How many tokens a call may write: one rule for every API (chat, completions, Messages,
Responses), but for the limit of a call that asks none.

Agents send one output limit whatever the model: Claude Code asks for ``max_tokens`` 32000
(64000 for some model names) unless ``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` is set, so on a model
whose context is smaller than that every call would be refused and the agent could not
start. The room a call has is what the context leaves after the prompt, or less where the KV
cache of every instance serving the model holds less (``router.instances.kv_room``):
- no limit asked: the room; on the text-completions API (``/v1/completions``), OpenAI's
  default of 16 tokens (vLLM's ``CompletionRequest`` has it too), or the room where that is
  less, cut silently (no clamp header, no refusal: the client asked for no limit);
- a limit that fits: that limit;
- a limit beyond the room, under the rule ``"clamp"`` (the default): the room. The response
  names the clamp in the header ``X-Talaria-Max-Tokens-Clamped: <asked>-><room>``, and an
  answer that reaches it ends as each API ends an answer cut by its limit
  (``finish_reason: "length"``, ``stop_reason: "max_tokens"``; the Responses API's
  ``context_length_exceeded``, as when no limit was asked, since the context, not the
  client's limit, ended it);
- under ``"refuse"`` (per model or for the router: the behaviour before clamping), a 400
  naming the field and the room (:class:`OutputOverflow`); on the Messages API in Anthropic's
  words, ``input length and `max_tokens` exceed context limit: N + M > L``, which Claude Code
  parses to retry with a max_tokens that fits.
Counting tokens (``/v1/messages/count_tokens``) asks for no output and is not affected.
"""

from __future__ import annotations

from dataclasses import dataclass

from talaria.protocol.errors import ApiError

__all__ = ["CLAMP_HEADER", "OVERFLOW_RULES", "OutputBudget", "OutputOverflow", "output_budget"]

OVERFLOW_RULES = ("clamp", "refuse")
CLAMP_HEADER = "X-Talaria-Max-Tokens-Clamped"


@dataclass(frozen=True)
class OutputBudget:
    max_tokens: int  # what the instance is asked to write at most
    asked: int | None = None  # the client's limit (None: none asked)

    @property
    def clamped(self) -> bool:
        return self.asked is not None and self.asked > self.max_tokens

    def headers(self) -> dict[str, str]:
        """The response header that names a clamp (none when the client's limit stood)."""
        return {CLAMP_HEADER: f"{self.asked}->{self.max_tokens}"} if self.clamped else {}


class OutputOverflow(ApiError):
    """400 under the rule ``"refuse"``: ``asked`` output tokens beside a prompt of
    ``prompt_tokens`` do not fit the ``room`` left."""

    def __init__(self, message: str, param: str, prompt_tokens: int, asked: int, room: int) -> None:
        super().__init__(400, message, param=param, code="invalid_value")
        self.prompt_tokens, self.asked, self.room = prompt_tokens, asked, room

    def anthropic_message(self) -> str:
        """Anthropic's words for it (Claude Code reads the three numbers to retry)."""
        return (f"input length and `max_tokens` exceed context limit: {self.prompt_tokens} + {self.asked} > "
                f"{self.prompt_tokens + self.room}, decrease input length or `max_tokens` and try again")


def output_budget(
    asked: int | None, prompt_tokens: int, room: int, limit: str, rule: str, param: str,
    default: int | None = None,
) -> OutputBudget:
    """The output budget of a call whose prompt has ``prompt_tokens`` tokens and leaves
    ``room`` (>= 1; checked before) under ``limit`` (what bounds it, in words); ``param``
    names the client's field in a refusal. ``default``: the limit when none is asked (None:
    the room), never more than the room."""
    if rule not in OVERFLOW_RULES:
        raise ValueError(f"unknown max_tokens overflow rule {rule!r}; choose from {OVERFLOW_RULES}")
    if asked is None:
        return OutputBudget(room if default is None else min(default, room))
    if asked <= room:
        return OutputBudget(asked, asked)
    if rule == "refuse":
        raise OutputOverflow(
            f"{param} is {asked} but the prompt has {prompt_tokens} tokens and {limit}: at most "
            f"{room} tokens fit", param, prompt_tokens, asked, room,
        )
    return OutputBudget(room, asked)
