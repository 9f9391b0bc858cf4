"""What a chat request passes to its model's chat template besides the conversation and the
tools: the chat API's ``chat_template_kwargs``, and the thinking switch.

``chat_template_kwargs`` (as vLLM's and SGLang's) is an object whose entries reach the template
as variables, as transformers' ``apply_chat_template(**kwargs)`` passes them. The common one is
``enable_thinking: false``: Qwen3's template then writes an empty ``<think>\\n\\n</think>\\n\\n``
after the generation prompt and the model answers without thinking (``router.api.reasoning``
reads that prompt's end: the answer is then all content). A key the renderer sets itself
(:data:`RENDERER_ARGUMENTS`: the conversation, ``tools``, ``add_generation_prompt``, the
tokenizer's special tokens, ...) is a 400 naming it, since it would replace what the router
renders or fail inside transformers; any other key is passed as it is (one the template does
not read changes nothing; vLLM drops such keys instead).

The thinking switch is ``{"enable_thinking": on, "thinking": on}``: Qwen3's and GLM-4.5's
templates read the first, DeepSeek-V3.1's and Granite's the second (SGLang sets both alike).
Chat's ``reasoning_effort`` and a Responses ``reasoning.effort`` set it (:func:`effort_switch`:
``none`` or ``minimal``: off, since a switch has no "few tokens" setting and ``minimal`` asks
for the fastest answer; ``low`` up to ``max``: on; SGLang turns only ``none`` off; no effort
leaves the template's default), and so does Anthropic's ``thinking``
(:func:`thinking_switch`, ``router.api.anthropic_schema``: on only when enabled). An entry the
request wrote in ``chat_template_kwargs`` wins over the switch. A template that reads neither
key leaves the model thinking as it always does.
"""

from __future__ import annotations

from typing import Any

from talaria.protocol.errors import bad_request

__all__ = ["EFFORTS", "RENDERER_ARGUMENTS", "chat_template_kwargs", "effort_switch", "thinking_switch"]

# apply_chat_template's own arguments (transformers 5), the variables it renders the template
# with, and the special tokens it passes as variables (a request's would replace them)
RENDERER_ARGUMENTS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
})
# OpenAI's reasoning efforts -> whether the model thinks
EFFORTS: dict[str, bool] = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
                            "xhigh": True, "max": True}


def chat_template_kwargs(value: Any, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` (null: none), checked."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object of the chat template's variables", param)
    clash = sorted(RENDERER_ARGUMENTS.intersection(value))
    if clash:
        raise bad_request(f"{param}.{clash[0]} is set by the server when it renders the chat template; "
                          "a request cannot pass it", f"{param}.{clash[0]}")
    return dict(value)


def thinking_switch(on: bool) -> dict[str, Any]:
    """The template variables that switch a thinking model's thinking on or off."""
    return {"enable_thinking": on, "thinking": on}


def effort_switch(effort: Any, param: str) -> dict[str, Any]:
    """The thinking switch an OpenAI reasoning effort read from ``param`` sets (null: none)."""
    if effort is None:
        return {}
    if not isinstance(effort, str) or effort not in EFFORTS:
        raise bad_request(f"{param} must be one of {list(EFFORTS)}", param)
    return thinking_switch(EFFORTS[effort])
