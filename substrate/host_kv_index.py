"""Which KV blocks the host KV store holds: pure bookkeeping, torch-free.

Keys are ``(model, block_hash)``, the hash being the engine's chained prefix hash of a full
block, so the host store answers the same prefix queries as the device prefix cache. The
index is bounded in bytes and never refuses an insert for lack of room: it evicts least
recently used blocks first, except that blocks of a held session (``hold``: one with a soft
reservation on the live instance) go only once no other block is left to evict.

Within one chain, ``touch`` stamps the head as the most recent block, so under LRU the tail
of a prefix is evicted before its head (a missing block ends a restored prefix there, so a
hole near the head would waste every block after it).

Used by the live store (substrate.host_kv, with tensor payloads) and by the simulator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from substrate.prefix_presence import PrefixPresence

HostKVKey = tuple[str, int]


@dataclass(eq=False)  # compared by identity: ``None in found`` stays at C speed
class HostKVEntry:
    model: str
    block_hash: int
    nbytes: int
    sessions: set[str] = field(default_factory=set)  # sessions that saved this block

    @property
    def key(self) -> HostKVKey:
        return (self.model, self.block_hash)


@dataclass
class ChainInsert:
    """Outcome of ``insert_chain``: the hashes newly inserted (a prefix of the chain's new
    blocks, in chain order) and the entries evicted to make room."""

    inserted: list[int]
    evicted: list[HostKVEntry]


class HostKVIndex:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host KV capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._held: set[str] = set()  # sessions whose blocks are evicted last
        # session -> model -> the chain it saved last (``follow``: the live store only)
        self._chains: dict[str, dict[str, list[int]]] = {}
        # least recently used first: the order is the recency (``touch`` moves to the end)
        self._entries: OrderedDict[HostKVKey, HostKVEntry] = OrderedDict()
        self._model_bytes: dict[str, int] = {}
        self.version = 0  # bumped whenever the set of stored blocks changes
        self._watchers: list[ChainLookups] = []  # told each block stored or removed

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def hold(self, session_id: str, held: bool = True) -> None:
        """Evict the blocks ``session_id`` saved (of the chains it still continues: ``follow``)
        only once no block of a session not held is left to evict (``held=False``: as any
        other again). Holding costs eviction nothing while no session is held (the simulator
        holds none)."""
        if held:
            self._held.add(session_id)
        else:
            self._held.discard(session_id)

    def follow(self, session_id: str, model: str, block_hashes: Sequence[int]) -> None:
        """``session_id`` saved ``block_hashes`` on ``model`` (after ``insert_chain``): the
        blocks of the chain it saved there last that this one does not continue (it forked
        from an earlier call; a compaction started it afresh) are no longer its, so holding
        it keeps them no more. A head of the last chain (the device kept only that) changes
        nothing. The simulator never calls this (its store holds nothing)."""
        chains = self._chains.setdefault(session_id, {})
        last = chains.get(model)
        if last is not None:
            common = 0
            for old, new in zip(last, block_hashes, strict=False):
                if old != new:
                    break
                common += 1
            if common == len(block_hashes):
                return
            self._untag(session_id, model, last[common:])
        chains[model] = list(block_hashes)

    def forget(self, session_id: str) -> None:
        """The session is gone: no block it saved (as far as ``follow`` was told) is its
        any more, and it is held no more; a new session under its id starts with none."""
        self._held.discard(session_id)
        for model, chain in self._chains.pop(session_id, {}).items():
            self._untag(session_id, model, chain)

    def _untag(self, session_id: str, model: str, block_hashes: Iterable[int]) -> None:
        entries = self._entries
        for h in block_hashes:
            entry = entries.get((model, h))
            if entry is not None:
                entry.sessions.discard(session_id)

    def get(self, model: str, block_hash: int) -> HostKVEntry | None:
        return self._entries.get((model, block_hash))

    def entries(self) -> list[HostKVEntry]:
        """All entries, least recently used first."""
        return list(self._entries.values())

    def bytes_of(self, model: str) -> int:
        return self._model_bytes.get(model, 0)

    def models(self) -> list[str]:
        return [m for m, b in self._model_bytes.items() if b > 0]

    def lookup(self, model: str, block_hashes: Sequence[int], touch: bool = True) -> int:
        """How many leading hashes of the chain are present (stops at the first missing);
        with ``touch`` those become the most recently used."""
        n = 0
        for h in block_hashes:
            if (model, h) not in self._entries:
                break
            n += 1
        if touch and n:
            self.touch(model, block_hashes[:n])
        return n

    def touch(self, model: str, block_hashes: Sequence[int]) -> None:
        """Mark present blocks of a chain most recently used, the head most recent."""
        entries, move = self._entries, self._entries.move_to_end
        for h in reversed(block_hashes):
            key = (model, h)
            if key in entries:
                move(key)

    def insert_chain(
        self,
        model: str,
        block_hashes: Sequence[int],
        block_nbytes: int,
        session_id: str | None = None,
    ) -> ChainInsert:
        """Insert the chain's blocks not yet present (each ``block_nbytes``), evicting other
        blocks as needed. Blocks of this chain already present are kept and touched. If not
        all new blocks fit even after evicting everything else, the leading ones that fit
        are inserted and the rest dropped (an unreachable tail is worthless)."""
        if block_nbytes <= 0:
            raise ValueError(f"a KV block must have > 0 bytes, got {block_nbytes}")
        entries = self._entries
        keys = [(model, h) for h in block_hashes]
        found = list(map(entries.get, keys))  # one lookup per block, reused below
        new: list[int] = []
        if None in found:
            seen: set[int] = set()
            for h, entry in zip(block_hashes, found, strict=True):
                if entry is None and h not in seen:
                    new.append(h)
                    seen.add(h)
        evicted: list[HostKVEntry] = []
        if len(new) * block_nbytes > self.free_bytes:  # the chain's own blocks stay
            evicted = self._make_room(len(new) * block_nbytes, protect=set(keys))
        fits = min(len(new), max(0, self.free_bytes) // block_nbytes)
        inserted = new[:fits]
        for h in inserted:
            entry = HostKVEntry(model, h, block_nbytes)
            entries[entry.key] = entry
            self.version += 1
            self._add_bytes(model, block_nbytes)
            for watcher in self._watchers:
                watcher.added(model, h)
        if inserted:
            found = list(map(entries.get, keys))
        if session_id is not None:
            for entry in found:
                if entry is not None:
                    entry.sessions.add(session_id)
        # touch (as ``touch``): the head ends most recent
        move = entries.move_to_end
        for key, entry in zip(reversed(keys), reversed(found), strict=True):
            if entry is not None:
                move(key)
        return ChainInsert(inserted, evicted)

    def remove(self, model: str, block_hash: int) -> HostKVEntry | None:
        entry = self._entries.pop((model, block_hash), None)
        self.version += 1
        if entry is not None:
            self._add_bytes(model, -entry.nbytes)
            for watcher in self._watchers:
                watcher.removed(model, block_hash)
        return entry

    def drop_model(self, model: str) -> list[HostKVEntry]:
        """Remove every block of ``model``; returns them."""
        keys = [key for key in self._entries if key[0] == model]
        return [e for e in (self.remove(*key) for key in keys) if e is not None]

    def evict(self, nbytes: int, protect: Iterable[HostKVKey] = ()) -> list[HostKVEntry]:
        """Evict until ``nbytes`` are free (or nothing evictable is left)."""
        return self._make_room(nbytes, protect=set(protect))

    def _make_room(self, nbytes: int, protect: set[HostKVKey]) -> list[HostKVEntry]:
        need = nbytes - self.free_bytes
        if need <= 0:
            return []
        if self._held:
            candidates = self._held_last(need, protect)
        else:
            # oldest first; only as many entries as the room needs are visited
            candidates = []
            room = 0
            for key, e in self._entries.items():
                if room >= need:
                    break
                if key not in protect:
                    candidates.append(e)
                    room += e.nbytes
        evicted: list[HostKVEntry] = []
        for entry in candidates:
            if need <= 0:
                break
            self.remove(entry.model, entry.block_hash)
            evicted.append(entry)
            need -= entry.nbytes
        return evicted

    def _held_last(self, need: int, protect: set[HostKVKey]) -> list[HostKVEntry]:
        """Entries to evict for ``need`` bytes: those of no held session oldest first, then,
        if that is not room enough, held sessions' oldest first. Visits entries until the
        room is found (held ones it passes are visited twice at most)."""
        held = self._held
        first: list[HostKVEntry] = []
        later: list[HostKVEntry] = []
        room = 0
        for key, e in self._entries.items():
            if room >= need:
                return first
            if key in protect:
                continue
            if held.isdisjoint(e.sessions):
                first.append(e)
                room += e.nbytes
            else:
                later.append(e)
        for e in later:
            if room >= need:
                break
            first.append(e)
            room += e.nbytes
        return first

    def _add_bytes(self, model: str, delta: int) -> None:
        self.used_bytes += delta
        self._model_bytes[model] = self._model_bytes.get(model, 0) + delta


class ChainLookups:
    """``HostKVIndex.lookup`` (read-only) for chains asked about again and again, such as
    every session's at each state refresh: each key's chain (a session id's) is registered
    once (again when it changes: a chain of chained hashes is named by its length and last
    hash) and its answer kept up to date as the index stores and removes blocks
    (``PrefixPresence``), so a lookup costs no walk. One entry per key until ``forget``."""

    def __init__(self, index: HostKVIndex) -> None:
        # The index tells this object its changes; this keeps only the index's entries (no
        # reference cycle: both go as soon as their engine does).
        self._entries = index._entries
        self._models: dict[str, PrefixPresence] = {}
        self._model_of: dict[str, str] = {}
        index._watchers.append(self)

    def lookup(self, key: str, model: str, chain: Sequence[int]) -> int:
        presence = self._models.get(model)
        if presence is None:
            entries = self._entries
            presence = self._models[model] = PrefixPresence(
                lambda h: (model, h) in entries)
        known = presence.chain(key) if self._model_of.get(key) == model else None
        if known is None or len(known) != len(chain) or (chain and known[-1] != chain[-1]):
            if self._model_of.get(key) != model:
                self.forget(key)
            presence.set_chain(key, list(chain))
            self._model_of[key] = model
        return presence.count(key)

    def forget(self, key: str) -> None:
        model = self._model_of.pop(key, None)
        if model is not None:
            self._models[model].drop(key)

    def added(self, model: str, block_hash: int) -> None:
        presence = self._models.get(model)
        if presence is not None:
            presence.added(block_hash)

    def removed(self, model: str, block_hash: int) -> None:
        presence = self._models.get(model)
        if presence is not None:
            presence.removed(block_hash)
