"""How an engine's host KV tier behaves: when KV gets there, what bringing it back costs.

Three stores are modelled, five tiers in all (keyed by the chained block hash, in the host
KV index):

- ``offload`` (Talaria's host KV store): the admission loop copies sessions' KV to host when
  it switches the model out (or a reservation yields); a returning call restores its longest
  prefix at the pinned host-link rate, inside the forward pass that reads it: the copy runs
  on a side stream in ``substrate.moves.KV_RESTORE_LAYER_GROUPS`` groups of layers
  (``substrate.layer_loads``), group g+1 copied while group g computes, so only the first
  group's copy is exposed. On a device that cannot copy while it computes (a CPU), serial.
- ``offload_serial``: the same store restoring every block before the forward pass starts
  (the copy and the compute add up): what Talaria did before its layer-wise restore.
- ``lmcache`` (vLLM + LMCache's CPU backend): KV is written through to a pinned host buffer as
  it is computed, synchronously at the end of the forward pass; a hit is retrieved before the
  forward pass. Rates from LMCache's own log (LMCache PR #1740): "Stored ... throughput: 44.41
  GB/s", "Retrieved ... throughput: 41.12 GB/s". Best settings (LMCache configurations.rst):
  ``save_decode_cache`` and ``save_unfull_chunk`` on, so generated tokens are kept too, and
  the CPU size raised to the host memory left (the 5 GB default would hold one session). The
  buffer lives outside vLLM's cuMem pool, so it survives sleep and wake.
- ``lmcache_layerwise``: the same with ``use_layerwise`` (vLLM's LMCacheConnectorV1 extra
  config; ``LMCACHE_USE_LAYERWISE``): each layer's KV is retrieved before that layer runs
  (``wait_for_layer_load``) and stored after it (``save_kv_layer``), both overlapping the
  other layers' compute, at the same rates.
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

from substrate.moves import KV_RESTORE_LAYER_GROUPS

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
    # With restore_overlaps_compute: 0, loaded layer by layer (the step takes the larger of
    # its compute and its load); n, pipelined over n groups of layers (the first exposed).
    restore_overlap_groups: int = 0
    store_overlaps_compute: bool = False  # write-through copied layer by layer as computed


KV_TIERS: dict[str, KVTier] = {
    t.name: t
    for t in (
        KVTier("offload", False, None, None, True, True,
               restore_overlap_groups=KV_RESTORE_LAYER_GROUPS),
        KVTier("offload_serial", False, None, None, False, True),
        KVTier("lmcache", True, 44.41e9, 41.12e9, False, True),
        KVTier("lmcache_layerwise", True, 44.41e9, 41.12e9, True, True,
               store_overlaps_compute=True),
        KVTier("hicache", True, None, None, True, False),
    )
}


def kv_tier(name: str) -> KVTier:
    try:
        return KV_TIERS[name]
    except KeyError:
        raise ValueError(f"unknown KV tier {name!r}; known: {', '.join(KV_TIERS)}") from None
