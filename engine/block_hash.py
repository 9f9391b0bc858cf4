"""The chained block hash that names a prefix of token ids, everywhere in Talaria.

Block k of a token sequence (tokens ``[k * block_size, (k + 1) * block_size)``) is named by
``h_k = blake2b(h_{k-1} || tokens of block k)``, 8 bytes; equal ``h_k`` means (with
overwhelming probability) equal first ``(k + 1) * block_size`` tokens. The engine's prefix
cache, the host KV store and the router's prefix index all key KV by these hashes, so the
router can tell which instance holds a prompt's prefix in the same terms as the engine that
holds it. Stable across processes and machines (no Python ``hash``). Torch-free.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockChain", "block_hashes", "hash_block_tokens"]

_ROOT = b"talaria-kv-root"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The hash of one block's tokens chained to its parent block's hash (None: first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOT if parent_hash is None else parent_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``, continuing ``parent``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out


@dataclass(frozen=True)
class BlockChain:
    """The full-block hash chain of a token sequence (``block_hashes`` at ``block_size``), sent
    along with the tokens by a sender that has it anyway, so that no receiver hashes them again.
    Its list is shared between receivers: none may change it (copy to extend)."""

    block_size: int
    hashes: list[int]

    def of(self, num_tokens: int, block_size: int) -> list[int] | None:
        """The chain for ``num_tokens`` tokens at ``block_size``; None when it cannot be that
        chain (another block size or length): the receiver hashes the tokens itself."""
        if block_size != self.block_size or len(self.hashes) != num_tokens // block_size:
            return None
        return self.hashes
