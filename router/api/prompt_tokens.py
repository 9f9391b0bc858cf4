"""A request's prompt as token ids, and the refusal of a prompt the model cannot take.

A prompt's size is checked before it is tokenized (its bytes, or the count of its token
ids, ``router.limits``); a text over the byte bound (:class:`PromptTooLarge`) or, once
tokenized, a prompt that leaves no token for the answer is a :class:`ContextOverflow`: a 400 each API's clients recognise as a context overflow (agents
compact or truncate on it): ``code: "context_length_exceeded"`` naming the request's prompt
field on the OpenAI APIs, ``prompt is too long: N tokens > M maximum`` on Anthropic's
(``router.api.anthropic_api``). A pure token count (``count_tokens``) is not bounded by the
context: it is how a client learns how far over the window it is.
"""

from __future__ import annotations

from aiohttp import web

from router.api.body_limits import off_loop_if_large
from router.api.openai_schema import CompletionBody
from router.limits import LIMITS_KEY, prompt_bytes
from router.tokenization import ModelTokenizer, Prompt
from talaria.protocol.errors import ApiError, bad_request

__all__ = ["ContextOverflow", "PromptTooLarge", "check_prompt_bytes", "check_prompt_len", "tokenize_prompt"]


class ContextOverflow(ApiError):
    """400: a prompt of ``prompt_tokens`` tokens, over the ``max_prompt_tokens`` its model
    (context or KV cache) can take with room left for one output token."""

    def __init__(self, message: str, param: str, prompt_tokens: int, max_prompt_tokens: int) -> None:
        super().__init__(400, message, param=param, code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.max_prompt_tokens = max_prompt_tokens

    def anthropic_message(self) -> str:
        """Anthropic's words for it (Claude Code and proxies match ``prompt is too long``)."""
        return f"prompt is too long: {self.prompt_tokens} tokens > {self.max_prompt_tokens} maximum"


class PromptTooLarge(ContextOverflow):
    """A prompt's text longer than any tokenization of it could fit in the context: a context
    overflow as clients read one, its token count the least the bound allows (no token is
    longer than its bytes per token); a type of its own so that its refusal is counted by
    its reason (``talaria_router_rejected_total``)."""

    def anthropic_message(self) -> str:
        """Anthropic's words first (what clients match and read the counts from), then why."""
        return f"{super().anthropic_message()}; {self.message}"


def check_prompt_bytes(size: int, tok: ModelTokenizer, bytes_per_token: int, param: str) -> None:
    """:class:`PromptTooLarge` for a text that cannot fit the context whatever it tokenizes to."""
    limit = tok.context_len * bytes_per_token
    if size > limit:
        least = -(-size // bytes_per_token)
        raise PromptTooLarge(
            f"the prompt is {size} bytes long, so at least {least} tokens; model {tok.name!r} allows at "
            f"most {tok.context_len - 1} prompt tokens (context length {tok.context_len}), and no prompt "
            f"over {limit} bytes is accepted ({bytes_per_token} bytes per token)",
            param, least, tok.context_len - 1,
        )


def check_prompt_len(n: int, tok: ModelTokenizer, param: str) -> None:
    if n >= tok.context_len:
        raise ContextOverflow(
            f"the prompt has {n} tokens; model {tok.name!r} allows at most "
            f"{tok.context_len - 1} prompt tokens (context length {tok.context_len})",
            param, n, tok.context_len - 1,
        )


async def tokenize_prompt(
    request: web.Request, tok: ModelTokenizer, body: CompletionBody, prefill: str,
    within_context: bool = True,
) -> Prompt:
    """Token ids of the request's prompt, its size checked first (``router.limits``): the
    bytes of its text, or the count of its token ids before any id is looked at. With
    ``within_context`` False (a token count), a prompt over the context is counted, not
    refused; the byte bound still applies. A chat prompt is rendered with the request's
    ``template_kwargs``."""
    limits = request.app[LIMITS_KEY]
    param = body.prompt_param
    size = await off_loop_if_large(request, prompt_bytes, body.messages, body.prompt,
                                   body.tools.tools)
    size += len(prefill.encode())
    check_prompt_bytes(size, tok, limits.max_prompt_bytes_per_token, param)
    try:
        if body.messages is not None:
            prompt = await tok.tokenize_chat(body.messages, size, body.tools.tools, prefill, body.template_kwargs)
        elif isinstance(body.prompt, str):
            prompt = Prompt(await tok.tokenize_text(body.prompt, size))
        elif body.prompt is not None:
            if within_context:
                check_prompt_len(len(body.prompt), tok, param)
            tok.check_token_ids(body.prompt)
            prompt = Prompt(list(body.prompt))
        else:
            raise bad_request("the request has neither messages nor prompt", param)
    except ValueError as exc:
        raise bad_request(str(exc), param) from exc
    except ApiError:
        raise
    except Exception as exc:  # a chat template that rejects the conversation raises its own types
        raise bad_request(f"cannot apply the chat template: {exc}", param) from exc
    if not prompt.ids:
        raise bad_request("the prompt tokenizes to nothing", param)
    if within_context:
        check_prompt_len(len(prompt.ids), tok, param)
    return prompt
