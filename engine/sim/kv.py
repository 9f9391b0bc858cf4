"""Session KV bookkeeping of the simulated engine: what it remembers of a session's last
call, and the host KV index seen as the KV manager's secondary cache."""

from __future__ import annotations

from dataclasses import dataclass

from substrate.host_kv_index import HostKVIndex


@dataclass
class SessionRecord:
    """The last finished call of a session: its model, its KV block-hash chain (full blocks
    whose KV was computed) and its tokens (to reuse the chain for the next prompt)."""

    model: str
    block_hashes: list[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    def starts(self, tokens: list[int], n: int) -> bool:
        """Whether ``tokens[:n]`` equals this call's first ``n`` tokens (n within them)."""
        prompt = self.prompt_token_ids
        p = min(n, len(prompt))
        if tokens[:p] != (prompt if p == len(prompt) else prompt[:p]):
            return False
        return n == p or tokens[p:n] == self.output_token_ids[: n - p]


class HostKVSecondary:
    """The host KV index as the KV manager's secondary cache for one model; counts the blocks
    loaded so the step that restores them is charged for the copy."""

    def __init__(self, index: HostKVIndex, model: str) -> None:
        self.index = index
        self.model = model
        self.loaded_blocks = 0

    def lookup(self, block_hashes: list[int]) -> int:
        return self.index.lookup(self.model, block_hashes, touch=False)

    def load(self, block_hashes: list[int], block_ids: list[int]) -> None:
        self.index.touch(self.model, block_hashes)
        self.loaded_blocks += len(block_hashes)
