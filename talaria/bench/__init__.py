"""``make bench``: benchmarks that print ratios measured within one run (engine throughput
against transformers, tensor parallelism, substrate copies, the live multi-model engine).

Benchmarks live here and nowhere else; they may import ``engine`` and ``substrate``.
"""
