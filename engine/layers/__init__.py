"""Tensor-parallel layers shared by the model definitions: linear layers with a
``weight_loader`` per parameter, embeddings and LM head, MoE, norms, rotary embeddings,
activations.

May import: ``engine.parallel_context`` (and torch).
"""
