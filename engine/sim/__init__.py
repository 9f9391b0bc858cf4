"""The simulated engine: the live engine's torch-free core, driven by a cost model's clock.

``SimEngine`` (engine.py) implements the same ``MultiModelEngineProtocol`` as the live
multi-model engine with the same scheduler, KV manager and block pool, but prices every step
and move with ``CostModel`` (cost_model.py: roofline compute/memory, all-reduces, per-step
overhead, host-link and HBM copies) for real model shapes (model_spec.py + data/models/*.json)
on a server from ``substrate.devices``. ``config.py`` is its configuration, ``kv.py`` its
session/host-KV bookkeeping, ``step_time.py`` the closed-form pricing of decode runs.

Torch-free. May import: the engine core (``engine.*``) and ``substrate``.
"""
