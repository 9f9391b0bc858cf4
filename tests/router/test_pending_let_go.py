"""What a router's instance client holds for the next state poll: a forget covers a release,
a session id in use again is withdrawn from both, only what a poll carried is dropped, and
each kind is bounded (oldest first out)."""

from __future__ import annotations

from router.instances.let_go import PendingLetGo


def test_a_forget_covers_a_release_and_a_reused_id_is_withdrawn() -> None:
    held = PendingLetGo(bound=10)
    held.add_release(["a", "b", "c"])
    held.add_forget(["b", "d"])
    held.add_release(["d"])  # already to be forgotten: that covers it
    assert held.batch(10) == (["b", "d"], ["a", "c"])
    held.withdraw("a")
    held.withdraw("d")
    assert held.batch(10) == (["b"], ["c"])


def test_only_what_a_poll_carried_is_dropped() -> None:
    held = PendingLetGo(bound=10)
    held.add_forget(["f1", "f2", "f3"])
    held.add_release(["r1", "r2"])
    forget, release = held.batch(2)
    assert (forget, release) == (["f1", "f2"], ["r1", "r2"])
    held.add_forget(["f4"])  # meanwhile
    held.sent()
    assert held.batch(10) == (["f3", "f4"], []) and held
    held.sent()
    assert not held


def test_each_kind_keeps_its_newest_up_to_the_bound() -> None:
    held = PendingLetGo(bound=3)
    held.add_forget([f"f{i}" for i in range(5)])
    held.add_release([f"r{i}" for i in range(5)])
    assert held.batch(10) == (["f2", "f3", "f4"], ["r2", "r3", "r4"])


def test_a_restored_let_go_outlives_the_poll_that_carried_it_before() -> None:
    """A refused call withdrew it while a poll carried it, then restored it: the poll's
    answer drops the carried (older) one, not the restored one, which goes out next."""
    held = PendingLetGo(bound=10)
    held.add_release(["s"])
    held.add_forget(["t"])
    assert held.batch(10) == (["t"], ["s"])
    withdrawn = (held.withdraw("s"), held.withdraw("t"))
    assert [(w.forget, w.release) for w in withdrawn] == [(False, True), (True, False)]
    held.settle("s", withdrawn[0], ran=False)
    held.settle("t", withdrawn[1], ran=False)
    held.sent()
    assert held.batch(10) == (["t"], ["s"])
    nothing = held.withdraw("u")
    assert (nothing.forget, nothing.release) == (False, False)
    held.settle("u", nothing, ran=False)  # nothing was withdrawn: nothing comes back
    assert held.batch(10) == (["t"], ["s"])
