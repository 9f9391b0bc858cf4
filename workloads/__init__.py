"""Workloads and the benchmark: agent-session traces (our format, readers of others, the
calibrated generator, model assignment), the systems compared (``systems``), the closed-loop
replay driver against an in-process simulated cluster or a live router, the isolated lower
bound, load and quantum sweeps, and the report.

The top layer: may import ``router``, ``talaria``, ``engine`` and ``substrate``.
"""
