"""One live engine serving a catalog of models on the instance-local substrate.

``MultiModelEngine`` (engine.py) keeps one ``EngineCore`` per model bound to fixed weight and
KV addresses of one device arena; ``rank.py`` does the device work of one rank, ``tp.py`` runs
it on every rank of a tensor-parallel group, ``catalog.py`` reads each model's config, weight
layout and KV shape without touching weights, ``rates.py`` measures what moves and steps cost.

May import: the engine core (``engine.*``) and ``substrate``; nothing above ``engine``.
"""

from engine.multi_model.config import MultiModelConfig
from engine.multi_model.engine import MultiModelEngine
from engine.served_models import ModelNotActiveError

__all__ = ["ModelNotActiveError", "MultiModelConfig", "MultiModelEngine"]
