"""Pieces of the ChatML chat templates with tools that the tiny models and SmolLM2 share
(Jinja source, rendered by transformers' ``apply_chat_template``)."""

from __future__ import annotations

__all__ = ["ASSISTANT_TURN", "TEXT_OF_MACRO"]

# ``text_of(content)``: a message's text, whether content is a string, a list of parts (only
# the text parts) or null.
TEXT_OF_MACRO = """\
{%- macro text_of(c) -%}
{%- if c is string -%}{{ c }}
{%- elif c is iterable -%}{%- for p in c -%}{%- if p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
"""

# One assistant turn: its text, then each tool call as <tool_call>{"name", "arguments"}
# </tool_call> (arguments a JSON string, OpenAI's wire form, or an object), inside the loop
# over ``message``.
ASSISTANT_TURN = """\
{%- set c = text_of(message.content) %}
{{- '<|im_start|>assistant\\n' + c }}
{%- for tc in (message.tool_calls or []) %}
{%- set f = tc.function if tc.function is defined else tc %}
{%- if c or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
"""
