"""The session table: records, TTL, the last call, and each session's KV chains (branches)."""

from __future__ import annotations

import pytest
from router_fakes import book_call

from router.sessions.table import SessionTable, branch_key
from talaria.protocol.text import block_hashes

MAIN = list(range(1, 100))  # 6 full blocks of 16


def test_session_table_books_and_ttl() -> None:
    table = SessionTable(ttl_s=100.0)
    record, branch = book_call(table, "s", MAIN, 0.0, 10.0, output=40)
    assert branch.key == "s" and branch.instance_id == "i" and branch.kv_tokens == 139
    assert branch.kv.blocks == 139 // 16 and record.instance_id == "i"
    again, same = book_call(table, "s", MAIN + [7] * 50, 12.5)
    assert again is record and same is branch and record.calls == 2 and record.active_calls == 1
    assert record.last_finish == 10.0
    table.end_call(record, branch, 20.0)  # it ran nowhere: the branch keeps what it had
    assert branch.kv_tokens == 139 and record.active_calls == 0
    assert table.cleanup(100.0) == [] and "s" in table
    assert [r.session_id for r in table.cleanup(121.0)] == ["s"] and len(table) == 0


def test_session_ends_on_last_call() -> None:
    table = SessionTable()
    book_call(table, "s", MAIN, 0.0, 1.0, last=True)
    assert "s" not in table
    for bad in ({"ttl_s": 0}, {"max_sessions": 0}, {"max_branches": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SessionTable(**bad)  # type: ignore[arg-type]


def test_a_last_call_ends_its_session_once_the_calls_beside_it_end() -> None:
    """A client's last call that ends while another call of its session is in flight (a
    side call) does not end the session then (that call is still running); the other call's
    end does, not the TTL (30 minutes by default), so its SCT is observed then."""
    table = SessionTable()
    side = [500 + t for t in range(40)]
    record, side_branch = book_call(table, "s", side, 0.0)  # a side call in flight
    book_call(table, "s", MAIN, 1.0, 5.0, last=True)  # the client's last call ends
    assert "s" in table  # the side call still runs
    table.end_call(record, side_branch, 6.0)
    assert "s" not in table


def test_a_call_joins_the_chain_its_prompt_continues() -> None:
    """The main loop's prompts extend each other; a side call of another prompt, or of another
    model, starts a chain of its own and never replaces the main loop's instance or KV."""
    table = SessionTable()
    record, main = book_call(table, "s", MAIN, 0.0, 1.0, instance="a", output=20)
    _, side = book_call(table, "s", [500 + k for k in range(40)], 2.0, 3.0, instance="b")
    _, other = book_call(table, "s", MAIN + [3] * 30, 4.0, 5.0, instance="c", model="haiku")
    assert (side.key, other.key) == ("s#1", "s#2") and main.instance_id == "a"
    assert main.kv_tokens == len(MAIN) + 20 and record.main is main and record.instance_id == "a"
    _, continued = book_call(table, "s", MAIN + [1] * 20 + [9] * 30, 6.0)
    assert continued is main and main.calls == 2
    # The last full block of the previous prompt may differ (a re-tokenised boundary)...
    boundary = MAIN[:95] + [77] * 30
    assert record.branch_for("m", boundary, _hashes(boundary)) is main
    # ...two may not, and a prompt under one block continues only what it repeats exactly.
    assert record.branch_for("m", MAIN[:79] + [77] * 30, _hashes(MAIN[:79] + [77] * 30)) is None
    _, short = book_call(table, "t", [1, 2, 3], 0.0, 1.0)
    assert table.get("t").branch_for("m", [1, 2, 3, 4], []) is short  # type: ignore[union-attr]
    assert table.get("t").branch_for("m", [1, 2, 4], []) is None  # type: ignore[union-attr]


def test_side_calls_since_the_main_loops_last_call_are_what_may_hold_its_slot() -> None:
    """Only the main loop reads them, and only side calls that ended after its own last call
    ended: an older one's model may have left the slot to other sessions since."""
    table = SessionTable()
    record, main = book_call(table, "s", MAIN, 0.0, 1.0, instance="a", output=20)
    assert record.side_calls_since(main) == ()
    _, old = book_call(table, "s", [700] * 40, 0.5, 0.8, instance="b", model="haiku")
    _, side = book_call(table, "s", [500] * 40, 2.0, 3.0, instance="a", model="haiku")
    _, running = book_call(table, "s", [600] * 40, 3.5, instance=None, model="haiku")
    assert record.main is main
    assert record.side_calls_since(main) == (("a", "haiku"),)  # not the older, nor the running
    assert record.side_calls_since(side) == ()  # a side call is held by nothing of this
    book_call(table, "s", MAIN + [1] * 20 + [9] * 30, 4.0, 5.0, instance="a")
    assert record.side_calls_since(main) == () and main.last_finish == 5.0
    assert old.last_finish == 0.8 and running.last_finish is None


def test_branches_are_bounded_and_the_main_loop_stays() -> None:
    table = SessionTable(max_branches=2)
    dropped: list[str] = []
    table.on_branch_drop = lambda b: dropped.append(b.key)
    record, main = book_call(table, "s", MAIN, 0.0, 1.0)
    book_call(table, "s", MAIN + [5] * 20, 1.5, 1.6)  # the main loop again: 2 calls
    for k in range(3):  # side calls, each a new prompt
        book_call(table, "s", [300 + k] * 40, 2.0 + k, 2.5 + k)
    assert dropped == ["s#1", "s#2"] and list(record.branches) == ["s", "s#3"]
    assert record.main is main
    one = SessionTable(max_branches=1)
    first, _ = book_call(one, "s", MAIN, 0.0, 1.0)
    _, side = book_call(one, "s", [300] * 40, 2.0)  # over the bound while its call runs
    assert list(first.branches) == ["s", "s#1"]
    one.end_call(first, side, 3.0)
    book_call(one, "s", [301] * 40, 4.0)  # the idle side branch goes, the main loop stays
    assert list(first.branches) == ["s", "s#2"]


def test_branch_keys_are_one_to_one() -> None:
    keys = {branch_key(s, n) for s in ("x", "x#1", "x#1#0", "y#") for n in range(3)}
    assert len(keys) == 12 and branch_key("x", 0) == "x" and branch_key("y#", 0) == "y#"
    assert branch_key("x#1", 0) == "x#1#0"


def _hashes(prompt: list[int]) -> list[int]:
    return block_hashes(prompt, 16)
