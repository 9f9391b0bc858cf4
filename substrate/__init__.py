"""Instance-local memory: the device arena (weight, staging and KV regions carved once, so
addresses stay stable across model switches), the host weight store, background staging, the
host KV store and its torch-free index, the ledger of what lives where, the movers that copy
bytes (torch live, modelled rates in simulation), and device/server specs.

The lowest layer: imports nothing from ``engine``, ``talaria``, ``router`` or ``workloads``.
"""
