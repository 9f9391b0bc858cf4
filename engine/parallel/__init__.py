"""Tensor-parallel process machinery: launching worker processes, the per-step command
channel, the runner that drives a model on every rank, and weight sharding plans.

The parallel context the layers take (``engine.parallel_context``) is not here: the layers
import it, and this package imports the layers. May import: the rest of ``engine``.
"""
