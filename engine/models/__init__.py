"""Model definitions: the shared decoder (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral), what it
reads from a Hugging Face config (``decoder_spec.py``), the architecture registry, loading a
checkpoint's safetensors through each parameter's weight loader (``loader.py``), and tiny
random-weight checkpoints in Hugging Face format for tests and demos (``tiny.py``).

May import: ``engine.layers``, ``engine.attention``, ``engine.parallel_context``.
"""
