"""Host KV index: byte bound, LRU order, held sessions evicted last, prefix lookup (pure
Python)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from substrate.host_kv_index import ChainLookups, HostKVIndex


def test_lookup_stops_at_the_first_missing_block() -> None:
    index = HostKVIndex(1000)
    index.insert_chain("m", [1, 2, 3, 4], 10)
    index.remove("m", 3)
    assert index.lookup("m", [1, 2, 3, 4]) == 2
    assert index.lookup("m", [2, 4]) == 2
    assert index.lookup("m", [9, 1]) == 0
    assert index.lookup("other", [1, 2]) == 0  # keyed by model too
    assert index.lookup("m", []) == 0


def test_byte_bound_and_lru_order() -> None:
    index = HostKVIndex(100)
    index.insert_chain("m", [1], 30)
    index.insert_chain("m", [2], 30)
    index.insert_chain("m", [3], 30)
    assert index.used_bytes == 90 and index.free_bytes == 10
    index.lookup("m", [1])  # 1 is now the most recent; 2 is the oldest
    result = index.insert_chain("m", [4], 30)
    assert [e.block_hash for e in result.evicted] == [2]
    assert result.inserted == [4]
    assert [e.block_hash for e in index.entries()] == [3, 1, 4]
    assert index.used_bytes == 90 <= index.capacity_bytes
    assert index.bytes_of("m") == 90 and index.models() == ["m"]


def test_within_a_chain_the_tail_is_evicted_before_the_head() -> None:
    index = HostKVIndex(40)
    index.insert_chain("m", [1, 2, 3, 4], 10)
    result = index.insert_chain("n", [7, 8], 10)
    assert [e.block_hash for e in result.evicted] == [4, 3]
    assert index.lookup("m", [1, 2, 3, 4]) == 2


def test_a_held_sessions_blocks_are_evicted_last() -> None:
    index = HostKVIndex(60)
    index.insert_chain("m", [1, 2], 10, session_id="keep")  # oldest, but held
    index.hold("keep")
    index.insert_chain("m", [3, 4], 10, session_id="drop")
    index.insert_chain("m", [5, 6], 10)
    result = index.insert_chain("m", [7, 8, 9, 10], 10)
    assert [e.block_hash for e in result.evicted] == [4, 3, 6, 5]  # unheld, oldest first
    assert index.lookup("m", [1, 2], touch=False) == 2
    result = index.insert_chain("m", [11, 12, 13, 14, 15], 10)  # more than the unheld hold
    assert [e.block_hash for e in result.evicted] == [10, 9, 8, 7, 2]  # held ones last
    assert index.lookup("m", [1, 2], touch=False) == 1
    index.hold("keep", held=False)  # its reservation ended: least recently used again
    index.insert_chain("m", [16], 10)
    assert index.lookup("m", [1], touch=False) == 0


_HELD_OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "hold", "release"]), st.sampled_from(["a", "b", "c"]),
              st.lists(st.integers(0, 15), max_size=5)),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(0, 120), ops=_HELD_OPS)
def test_eviction_takes_unheld_blocks_oldest_first_then_held_ones(
    capacity: int, ops: list[tuple[str, str, list[int]]],
) -> None:
    """What an insert evicts is exactly: blocks of no held session, least recently used
    first, then held sessions' blocks, least recently used first, never the chain's own."""
    index = HostKVIndex(capacity)
    held: set[str] = set()
    for op, session, chain in ops:
        if op != "insert":
            index.hold(session, held=op == "hold")
            (held.add if op == "hold" else held.discard)(session)
            continue
        before = index.entries()
        new = {h for h in chain if ("m", h) not in index}
        need = len(new) * 10 - index.free_bytes
        own = {("m", h) for h in chain}
        order = [e for e in before if e.key not in own and not e.sessions & held]
        order += [e for e in before if e.key not in own and e.sessions & held]
        want: list[tuple[str, int]] = []
        for e in order:
            if need <= 0:
                break
            want.append(e.key)
            need -= e.nbytes
        result = index.insert_chain("m", chain, 10, session_id=session)
        assert [e.key for e in result.evicted] == want
        assert index.used_bytes <= capacity


def test_a_chain_larger_than_capacity_keeps_its_head_and_never_fails() -> None:
    index = HostKVIndex(35)
    index.insert_chain("m", [100], 10)
    result = index.insert_chain("m", [1, 2, 3, 4, 5], 10)
    assert result.inserted == [1, 2, 3]
    assert [e.block_hash for e in result.evicted] == [100]
    assert index.lookup("m", [1, 2, 3, 4, 5]) == 3
    assert index.used_bytes == 30
    again = index.insert_chain("m", [1, 2, 3, 4], 10)  # present blocks are protected
    assert again.inserted == [] and again.evicted == []
    with pytest.raises(ValueError, match="> 0 bytes"):
        index.insert_chain("m", [1], 0)
    assert HostKVIndex(0).insert_chain("m", [1], 10).inserted == []


def test_sessions_and_drop_model() -> None:
    index = HostKVIndex(100)
    index.insert_chain("m", [1, 2], 10, session_id="a")
    index.insert_chain("m", [1, 2, 3], 10, session_id="b")
    index.insert_chain("n", [1], 10)
    entry = index.get("m", 1)
    assert entry is not None and entry.sessions == {"a", "b"}
    assert len(index.drop_model("m")) == 3
    assert index.used_bytes == 10 and index.bytes_of("m") == 0 and len(index) == 1


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(0, 200),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.lists(st.integers(0, 12), max_size=6),
            st.integers(1, 40),
        ),
        max_size=25,
    ),
)
def test_used_bytes_never_exceed_capacity(
    capacity: int, ops: list[tuple[str, list[int], int]]
) -> None:
    index = HostKVIndex(capacity)
    for model, chain, nbytes in ops:
        index.insert_chain(model, chain, nbytes)
        assert index.used_bytes <= capacity
        assert index.used_bytes == sum(e.nbytes for e in index.entries())
        assert index.used_bytes == index.bytes_of("a") + index.bytes_of("b")


def test_index_and_ledger_import_without_torch() -> None:
    code = (
        "import sys, substrate.host_kv_index, substrate.ledger, substrate.moves; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


_CHAIN_OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "remove", "drop", "rechain", "forget"]),
              st.sampled_from(["a", "b"]), st.lists(st.integers(0, 2), max_size=6),
              st.sampled_from(["s1", "s2", "s3"])),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=_CHAIN_OPS)
def test_chain_lookups_answer_as_a_walk_of_the_index_does(
    ops: list[tuple[str, str, list[int], str]],
) -> None:
    """Kept up to date by the index's inserts, evictions and removals (no walk per lookup),
    a lookup answers what ``index.lookup`` would: the leading blocks present."""
    index = HostKVIndex(capacity_bytes=8 * 10)  # small: inserts evict
    lookups = ChainLookups(index)
    chains: dict[str, tuple[str, list[int]]] = {}
    for op, model, tokens, key in ops:
        hashes = [hash(tuple(tokens[: k + 1])) for k in range(len(tokens))]  # a chain
        if op == "insert":
            index.insert_chain(model, hashes, 10)
        elif op == "remove" and hashes:
            index.remove(model, hashes[0])
        elif op == "drop":
            index.drop_model(model)
        elif op == "rechain":
            chains[key] = (model, hashes)
        elif key in chains:
            del chains[key]
            lookups.forget(key)
        for k, (m, chain) in chains.items():
            assert lookups.lookup(k, m, chain) == index.lookup(m, chain, touch=False)
