"""How an engine's host KV tier behaves: when KV gets there, what bringing it back costs.

Three tiers are modelled (all keyed by the chained block hash, in the host KV index):

- ``offload`` (Talaria's host KV store): the admission loop copies sessions' KV to host when
  it switches the model out (or a reservation yields); a returning call restores its longest
  prefix at the pinned host-link rate, before its prefill.
- ``lmcache`` (vLLM + LMCache's CPU backend): KV is written through to a pinned host buffer as
  it is computed, synchronously at the end of the forward pass; a hit is retrieved before the
  forward pass. Rates from LMCache's own log (LMCache PR #1740): "Stored ... throughput: 44.41
  GB/s", "Retrieved ... throughput: 41.12 GB/s". Best settings (LMCache configurations.rst):
  ``save_decode_cache`` and ``save_unfull_chunk`` on, so generated tokens are kept too, and
  the CPU size raised to the host memory left (the 5 GB default would hold one session). The
  buffer lives outside vLLM's cuMem pool, so it survives sleep and wake.
- ``hicache`` (SGLang HiCache, write_through policy): every block computed on the device is
  also written to the host tier asynchronously (it shares the link, not the step); a prefix
  found in the host tier is loaded layer by layer while the previous layer computes
  ("Compute-Transfer Overlap", docs/advanced_features/hicache_design.md), so a step costs the
  larger of its compute and its load. Releasing the server's memory to switch models flushes
  the radix cache, host tier included (``release_memory_occupation`` -> ``flush_cache``).

Rates of ``None`` are the server's pinned host link.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KV_TIERS", "KVTier", "kv_tier"]


@dataclass(frozen=True)
class KVTier:
    name: str
    write_through: bool  # blocks go to host as they are computed (else: offloaded on demand)
    store_bytes_per_s: float | None  # write-through cost charged to the step; None: async
    restore_bytes_per_s: float | None  # host -> device
    restore_overlaps_compute: bool  # layer-wise load hidden behind the step's compute
    survives_switch: bool  # the model's host KV is still there after it is switched out
    offload_bytes_per_s: float | None = None  # device -> host, on demand (offload, swap)


KV_TIERS: dict[str, KVTier] = {
    t.name: t
    for t in (
        KVTier("offload", False, None, None, False, True),
        KVTier("lmcache", True, 44.41e9, 41.12e9, False, True),
        KVTier("hicache", True, None, None, True, False),
    )
}


def kv_tier(name: str) -> KVTier:
    try:
        return KV_TIERS[name]
    except KeyError:
        raise ValueError(f"unknown KV tier {name!r}; known: {', '.join(KV_TIERS)}") from None
