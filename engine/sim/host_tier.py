"""The simulated engine's host KV tier at work: what restores and write-through cost a step,
and what a switch leaves of the tier (the tier's behaviour is ``engine.sim.kv_tier``)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sim.cost_model import CostModel
from engine.sim.kv_tier import KVTier
from substrate.host_kv_index import HostKVIndex

__all__ = ["HostTier"]


class HostTier:
    def __init__(self, index: HostKVIndex, tier: KVTier, block_size: int) -> None:
        self.index = index
        self.tier = tier
        self.block_size = block_size
        self._written: dict[str, int] = {}  # request id -> leading blocks written through

    @property
    def enabled(self) -> bool:
        return self.index.capacity_bytes > 0

    def restore_bytes_per_s(self, cost: CostModel) -> float:
        """The tier's own restore rate (measured on one GPU alone) at the server's share of
        the host link, or the server's."""
        if self.tier.restore_bytes_per_s:
            return cost.host_copy_rate(self.tier.restore_bytes_per_s)
        return cost.kv_restore_bytes_per_s

    def restore_seconds(self, cost: CostModel, tokens: int) -> float:
        """Copying ``tokens`` tokens of KV back from the host tier, alone."""
        return cost.kv_copy_seconds(tokens, self.restore_bytes_per_s(cost))

    def offload_seconds(self, cost: CostModel, tokens: int) -> float:
        """Copying ``tokens`` tokens of KV to the host tier on demand."""
        rate = (cost.host_copy_rate(self.tier.offload_bytes_per_s) if self.tier.offload_bytes_per_s
                else cost.kv_offload_bytes_per_s)
        return cost.kv_copy_seconds(tokens, rate)

    def step_seconds(self, cost: CostModel, compute_s: float, restore_s: float) -> float:
        """A step that computes for ``compute_s`` and restores KV for ``restore_s``: serial;
        layer by layer, the larger of the two; or pipelined over G groups of layers (copy
        group g+1 while group g computes: the first copy, or the last compute, is exposed).
        Serial wherever the device cannot copy while it computes."""
        if restore_s <= 0:
            return compute_s
        if not (self.tier.restore_overlaps_compute and cost.device.copies_overlap_compute):
            return compute_s + restore_s
        groups = self.tier.restore_overlap_groups
        if groups <= 0:
            return max(compute_s, restore_s)
        return max(restore_s + compute_s / groups, compute_s + restore_s / groups)

    def with_store(self, cost: CostModel, step_s: float, store_s: float) -> float:
        """A step of ``step_s`` that also writes through for ``store_s``: after it, or
        alongside it when the tier stores layer by layer and the device copies while it
        computes."""
        if self.tier.store_overlaps_compute and cost.device.copies_overlap_compute:
            return max(step_s, store_s)
        return step_s + store_s

    def write_through(
        self, model: str, requests: Iterable[Request], kv: KVCacheManager, cost: CostModel
    ) -> float:
        """Write the requests' newly computed full blocks to the host tier (write-through
        tiers only); returns the seconds the copy takes (0 when asynchronous)."""
        if not self.tier.write_through or not self.enabled:
            return 0.0
        bs = self.block_size
        block_bytes = bs * cost.kv_bytes_per_token_per_gpu()
        stored = 0
        for req in requests:
            full = req.num_computed_tokens // bs
            done = self._written.get(req.request_id, 0)
            if full <= done:
                continue
            hashes = kv.block_hashes(req)[done:full]
            result = self.index.insert_chain(model, hashes, block_bytes, session_id=req.session_id)
            stored += len(result.inserted)
            self._written[req.request_id] = full
        if self.tier.store_bytes_per_s is None:
            return 0.0
        return stored * block_bytes / cost.host_copy_rate(self.tier.store_bytes_per_s)

    def forget(self, request_id: str) -> None:
        self._written.pop(request_id, None)

    def switched_out(self, model: str) -> None:
        """``model`` left the device: a tier that does not survive it forgets its KV."""
        if not self.tier.survives_switch:
            self.index.drop_model(model)
