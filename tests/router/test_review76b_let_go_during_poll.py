"""A state poll is in flight carrying a release (or a forget) of session ``k``; meanwhile a
call of ``k`` reaches the instance (withdrawing it), ends there, and the router lets ``k`` go
again (it moves on, or ends). The poll's answer must not drop that newer let-go: what the
instance got was the older one, applied before the call came, so the reservation that call
left would stay there until it expired (a forget: the session kept)."""

from __future__ import annotations

from router.instances.let_go import PendingLetGo


def test_a_let_go_renewed_while_a_poll_carries_the_old_one_stays_pending() -> None:
    held = PendingLetGo(bound=10)
    held.add_release(["k", "r"])
    held.add_forget(["f", "g"])
    forget, release = held.batch(10)  # the poll goes out carrying them
    held.withdraw("k")  # a call of each reaches the instance meanwhile ...
    held.withdraw("f")
    held.add_release(["k"])  # ... ends, and the router lets it go again
    held.add_forget(["f"])
    held.add_release(["r"])  # still pending, not renewed: the poll carries it
    held.sent()
    assert held.batch(10) == (["f"], ["k"])
    held.sent()
    assert not held
