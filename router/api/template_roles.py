"""Which message roles a model's chat template renders, so none is dropped in silence.

A chat template renders the roles it knows and skips the others without a word: a
``developer`` message (what OpenAI's current clients and openai-agents send) used to vanish
from the prompt behind a 200. The chat and Responses parsers fold ``developer`` into the
system message (``router.api.openai_schema.one_system``); whatever role is left is checked here
against what the template does with it: each role is rendered once, in a small probe
conversation that places it as agents do (a tool result after the call it answers), and
counts as rendered when its text comes out. A request with a role the template does not
render is refused with a 400 naming the role, never sent without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TemplateRoles"]

_MARK = "talaria-role-probe-1f9d"
_CALL = {"id": "probe1234",  # nine alphanumerics, as Mistral's templates demand
          "type": "function", "function": {"name": "probe", "arguments": {}}}
_PROBES: dict[str, list[dict[str, Any]]] = {
    "system": [{"role": "system", "content": _MARK}, {"role": "user", "content": "hi"}],
    "user": [{"role": "user", "content": _MARK}],
    "assistant": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK},
                  {"role": "user", "content": "go on"}],
    "tool": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
             {"role": "tool", "tool_call_id": "probe1234", "name": "probe", "content": _MARK}],
    "function": [{"role": "user", "content": "hi"}, {"role": "function", "name": "probe", "content": _MARK}],
}


class TemplateRoles:
    """One model's rendered roles, each probed on first use (then remembered)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._rendered: dict[str, bool] = {}

    def check(self, tokenizer: Any, messages: Sequence[dict[str, Any]]) -> None:
        """ValueError naming the first role ``tokenizer``'s template would drop."""
        for role in dict.fromkeys(m["role"] for m in messages):
            if not self.renders(tokenizer, role):
                known = sorted(r for r in _PROBES if self.renders(tokenizer, r))
                raise ValueError(
                    f"the chat template of model {self.model!r} does not render messages of role "
                    f"{role!r}; it would drop them (it renders {', '.join(known) or 'none'})")

    def renders(self, tokenizer: Any, role: str) -> bool:
        known = self._rendered.get(role)
        if known is None:
            known = self._rendered[role] = _probe(tokenizer, role)
        return known


def _probe(tokenizer: Any, role: str) -> bool:
    probe = _PROBES.get(role)
    if probe is None:
        return False
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses the role (raise_exception) does not render it
        return False
    return isinstance(text, str) and _MARK in text
