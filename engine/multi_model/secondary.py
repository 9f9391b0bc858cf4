"""The host KV store as one model's secondary cache, through the rank ops."""

from __future__ import annotations

from engine.multi_model.rank import RankModels
from engine.multi_model.tp import TensorParallelRankModels
from substrate.moves import MoveRecord


class RankSecondary:
    """The host KV store as one model's secondary cache (``SecondaryKVCache``), through the
    rank ops, so that at TP=N a restore is one more op every rank executes."""

    def __init__(self, rank: RankModels | TensorParallelRankModels, model: str) -> None:
        self.rank = rank
        self.model = model
        self._queued = False

    def lookup(self, block_hashes: list[int]) -> int:
        return self.rank.host_kv_lookup(self.model, block_hashes, touch=True)

    def load(self, block_hashes: list[int], block_ids: list[int]) -> None:
        """Queue the copy: the step's forward pass writes the blocks (``restore_kv``)."""
        self.rank.restore_kv(self.model, block_hashes, block_ids)
        self._queued = True

    def drain_records(self) -> list[MoveRecord]:
        """Records of the loads the last steps settled (asks the ranks only after a load)."""
        if not self._queued:
            return []
        self._queued = False
        return self.rank.take_kv_load_records(self.model)
