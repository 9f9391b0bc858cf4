"""PrefixPresence: kept counts of each chain's leading hashes in a changing set equal a walk."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from substrate.prefix_presence import PrefixPresence

_OPS = st.lists(
    st.tuples(st.sampled_from(["add", "add_all", "remove", "set", "drop", "clear"]),
              st.sampled_from(["a", "b", "c"]),
              st.lists(st.integers(0, 5), max_size=8)),
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(ops=_OPS)
def test_counts_equal_a_walk_of_each_chain(ops: list[tuple[str, str, list[int]]]) -> None:
    """Any sequences (shared hashes, repeats, chains replaced by ones that do or do not
    extend them), any order of set changes: each count is the leading run the set holds."""
    members: set[int] = set()
    presence = PrefixPresence(members.__contains__)
    chains: dict[str, list[int]] = {}
    for op, name, hashes in ops:
        if op == "add":
            for h in hashes:
                if h not in members:
                    members.add(h)
                    presence.added(h)
        elif op == "add_all":  # the set gains them all, then is told at once
            fresh = [h for h in dict.fromkeys(hashes) if h not in members]
            members.update(fresh)
            presence.added_all(fresh)
        elif op == "remove":
            for h in hashes:
                if h in members:
                    members.discard(h)
                    presence.removed(h)
        elif op == "set":
            old = chains.get(name, [])
            chain = old + hashes if hashes[:1] == [0] else hashes  # extend some, replace others
            chains[name] = chain
            presence.set_chain(name, list(chain))
        elif op == "drop":
            chains.pop(name, None)
            presence.drop(name)
        else:
            chains.clear()
            presence.clear()
        for n in ("a", "b", "c"):
            chain = chains.get(n, [])
            walk = next((i for i, h in enumerate(chain) if h not in members), len(chain))
            assert presence.count(n) == walk, (n, chain)
