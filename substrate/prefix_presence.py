"""How many leading hashes of named chains a changing set of hashes holds, kept up to date.

A KV prefix is a chain of chained block hashes, and a cache (the device prefix cache, the host
KV store) holds a set of them; what a session can reuse is the chain's longest prefix the set
holds. Walking every session's chain at every state refresh costs the chains' length each
time; :class:`PrefixPresence` instead keeps each chain's count and is told when the set gains
(``added``) or loses (``removed``) a hash, touching only the chains that hold that hash.

Invariant: ``count(name)`` equals the number of leading hashes of ``name``'s chain that
``present`` says are in the set, as long as every change of the set is told. Memory is two
dict entries per hash of each chain registered (chains leave with ``drop``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import repeat

__all__ = ["PrefixPresence"]


class PrefixPresence:
    def __init__(self, present: Callable[[Hashable], bool]) -> None:
        self._present = present
        self._chains: dict[str, Sequence[Hashable]] = {}
        self._counts: dict[str, int] = {}
        # Per hash nothing is allocated but dict entries (no tuple, no dict: millions of small
        # containers cost the garbage collector more than the bookkeeping itself):
        self._pos: dict[str, dict[Hashable, int]] = {}  # chain -> {hash: its first index}
        self._owner: dict[Hashable, str | set[str]] = {}  # hash -> the chain(s) holding it

    def __contains__(self, name: object) -> bool:
        return name in self._chains

    def chain(self, name: str) -> Sequence[Hashable] | None:
        return self._chains.get(name)

    def count(self, name: str) -> int:
        """Leading hashes of ``name``'s chain in the set (0 for an unknown name)."""
        return self._counts.get(name, 0)

    def set_chain(self, name: str, chain: Sequence[Hashable]) -> None:
        """Register (or replace) ``name``'s chain; the caller must not change it afterwards.
        A chain that extends the previous one (a session's next call) registers only its
        new hashes: chained hashes agree at index k only if they agree everywhere before."""
        old = self._chains.get(name)
        keep = _common_prefix(old, chain) if old is not None else 0
        if old is not None:
            self._unregister(name, old, keep)
        pos = self._pos.setdefault(name, {})
        owner = self._owner
        new = chain[keep:]
        if pos.keys().isdisjoint(new):  # reversed: a hash repeated in it keeps its first index
            indices = range(len(chain) - 1, keep - 1, -1)
            pos.update(zip(reversed(new), indices, strict=True))
        else:
            for index in range(keep, len(chain)):
                pos.setdefault(chain[index], index)
        if owner.keys().isdisjoint(new):  # no other chain holds them: one C-level update
            owner.update(zip(new, repeat(name)))
        else:
            for h in new:
                held = owner.get(h)
                if held is None:
                    owner[h] = name
                elif isinstance(held, str):
                    if held != name:
                        owner[h] = {held, name}
                else:
                    held.add(name)
        self._chains[name] = chain
        self._counts[name] = min(self._counts.get(name, 0), keep)
        self._extend(name)

    def drop(self, name: str) -> None:
        chain = self._chains.pop(name, None)
        if chain is None:
            return
        del self._counts[name]
        self._unregister(name, chain, 0)
        del self._pos[name]

    def _unregister(self, name: str, chain: Sequence[Hashable], start: int) -> None:
        pos = self._pos[name]
        owner = self._owner
        for index in range(start, len(chain)):
            h = chain[index]
            if pos.get(h) != index:
                continue  # a repeat: registered at its first index
            del pos[h]
            held = owner.get(h)
            if isinstance(held, str):
                del owner[h]
            elif held is not None:
                held.discard(name)
                if len(held) == 1:
                    owner[h] = next(iter(held))

    def clear(self) -> None:
        self._chains.clear()
        self._counts.clear()
        self._pos.clear()
        self._owner.clear()

    def added(self, h: Hashable) -> None:
        """The set now holds ``h``: chains whose count stopped just before it go further."""
        held = self._owner.get(h)
        if held is None:
            return
        for name in (held,) if isinstance(held, str) else held:
            if self._counts[name] == self._pos[name][h]:
                self._extend(name)

    def added_all(self, hashes: Iterable[Hashable]) -> None:
        """``added`` of each hash, once the set holds them all: a chain restored block by
        block is walked once (its first hash's ``added`` extends it over the rest, which then
        find it past them), not extended by one at each of its hashes."""
        for h in hashes:
            self.added(h)

    def removed(self, h: Hashable) -> None:
        """The set no longer holds ``h``: chains that held it end before it."""
        held = self._owner.get(h)
        if held is None:
            return
        counts = self._counts
        for name in (held,) if isinstance(held, str) else held:
            index = self._pos[name][h]
            if counts[name] > index:
                counts[name] = index

    def _extend(self, name: str) -> None:
        chain = self._chains[name]
        n = self._counts[name]
        present = self._present
        while n < len(chain) and present(chain[n]):
            n += 1
        self._counts[name] = n


def _common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading hashes two chains share. Chained hashes that agree at an index agree
    at every index before it, so a binary search finds it; the answer is checked (one C-speed
    comparison) and found item by item for sequences that are not such chains."""
    lo, hi = 0, min(len(a), len(b))  # invariant: the first lo agree; from hi on, unknown
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    if list(a[:lo]) == list(b[:lo]):
        return lo
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
