"""Scheduler: token budget, chunked prefill mixed with decodes, preemption, abort."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus, validate_prompt
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def make(num_blocks: int = 32, budget: int = 16, max_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), budget, max_seqs, max_model_len=256)


def req(rid: str, n: int, max_tokens: int = 4, base: int = 0) -> Request:
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step with a fake model: every sampling request gets token 7; requests
    reaching max_tokens finish."""
    out = s.schedule()
    s.update_after_step(out)
    for sch in out.scheduled:
        if sch.samples:
            r = sch.request
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    return out


def test_budget_and_chunked_prefill_with_decodes_first() -> None:
    s = make(budget=10)
    s.add_request(req("a", 3))
    out = step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 3)]
    s.add_request(req("b", 25, base=100))
    out = step(s)
    # a decodes first (1 token), b gets a 9-token prefill chunk: 10 tokens in all.
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 9
    assert not out.scheduled[1].samples
    out = step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    out = step(s)  # a finishes after this decode (4 tokens)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.scheduled[1].samples
    assert "a" not in s.requests
    assert s.requests["b"].num_output_tokens == 1
    for x in out.scheduled:
        assert x.num_new_tokens <= 10


def test_block_tables_and_positions_cover_the_context() -> None:
    s = make(budget=64)
    s.add_request(req("a", 9))
    out = step(s)
    assert out.scheduled[0].block_ids == [0, 1, 2]
    assert out.scheduled[0].token_ids == list(range(9))
    out = step(s)
    x = out.scheduled[0]
    assert (x.num_computed_tokens, x.num_new_tokens, x.token_ids) == (9, 1, [7])


def test_max_num_seqs_limits_admission() -> None:
    s = make(budget=64, max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, base=10 * i))
    out = step(s)
    assert [x.request_id for x in out.scheduled] == ["r0", "r1"]
    assert s.num_waiting == 1


def test_preemption_frees_blocks_and_recomputes() -> None:
    s = make(num_blocks=4, budget=64)
    s.add_request(req("a", 8, max_tokens=6))
    s.add_request(req("b", 8, max_tokens=6, base=50))
    step(s)  # both prefilled: 2 blocks each, pool full
    assert s.kv.num_free_blocks == 0
    out = step(s)  # a needs a third block: b (admitted last) is preempted
    assert out.preempted_ids == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert not s.kv.holds_blocks("b")
    assert s.waiting[0] is b
    outputs_b = list(b.output_token_ids)
    while "a" in s.requests:
        step(s)
    # b comes back, recomputes prompt + its output so far, then continues.
    out = step(s)
    x = out.scheduled[0]
    assert x.request_id == "b" and x.num_computed_tokens + x.num_new_tokens == 8 + len(outputs_b)
    while s.has_unfinished():
        step(s)
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 6
    assert s.kv.num_free_blocks == 4 and s.num_preemptions == 1


def test_preemption_takes_the_largest_priority_then_the_latest_admitted() -> None:
    # Three running requests of 2 blocks each in a 6-block pool; "a" needs a third block.
    s = make(num_blocks=6, budget=64)
    ranked = {"a": 5.0, "b": 9.0, "c": 1.0}
    for i, rid in enumerate("abc"):
        r = req(rid, 8, max_tokens=6, base=50 * i)
        r.priority = ranked[rid]
        s.add_request(r)
    step(s)
    assert s.kv.num_free_blocks == 0
    out = step(s)
    assert out.preempted_ids == ["b"]  # the largest, though admitted second (FCFS takes "c")
    # among equals, the latest admitted: FCFS as before
    s2 = make(num_blocks=6, budget=64)
    for i, rid in enumerate("abc"):
        r = req(rid, 8, max_tokens=6, base=50 * i)
        r.priority = 3.0 if rid != "a" else 0.0
        s2.add_request(r)
    step(s2)
    assert step(s2).preempted_ids == ["c"]


def test_a_request_that_ranks_largest_preempts_itself() -> None:
    s = make(num_blocks=4, budget=64)
    first, second = req("a", 8, max_tokens=6), req("b", 8, max_tokens=6, base=50)
    first.priority = 2.0  # "a" needs a block and is itself the one to go
    s.add_request(first)
    s.add_request(second)
    step(s)
    out = step(s)
    assert out.preempted_ids == ["a"] and out.is_empty  # nothing after it runs (vLLM's rule)
    assert first.status == RequestStatus.PREEMPTED and s.waiting[0] is first
    assert [x.request_id for x in step(s).scheduled] == ["b"]


def _two_ranked() -> tuple[Scheduler, Request, Request]:
    """"a" (7 tokens, ranked to go first) and "b" (8) in a 4-block pool, not yet scheduled."""
    s = make(num_blocks=4, budget=64)
    a, b = req("a", 7, max_tokens=3), req("b", 8, max_tokens=3, base=50)
    a.priority = 1.0
    s.add_request(a)
    s.add_request(b)
    return s, a, b


def test_a_victim_scheduled_earlier_in_the_step_is_taken_back() -> None:
    # "a" (7 tokens) decodes within its second block; "b" (8) needs a third: the pool is full,
    # and "a", ranked to go first, was already scheduled this step.
    s, a, b = _two_ranked()
    step(s)
    out = step(s)
    assert out.preempted_ids == ["a"]
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1)]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 0)
    assert s.kv.block_ids("b") and not s.kv.holds_blocks("a")
    while s.has_unfinished():
        step(s)
    assert a.num_output_tokens == b.num_output_tokens == 3
    assert s.kv.num_free_blocks == 4


def test_a_victim_skipped_earlier_in_the_step_is_preempted_without_being_taken_back() -> None:
    # "a" (ranked to go first) has no token to compute, so the step skipped it; "b" needs a
    # third block of the full pool: "a" goes, though nothing of it was scheduled.
    s, a, b = _two_ranked()
    out = s.schedule()
    s.update_after_step(out)
    b.output_token_ids.append(7)  # only b's sampled token has come back
    out = s.schedule()
    assert out.preempted_ids == ["a"]
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1)]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 0)


def _three_decoding(budget: int) -> tuple[Scheduler, Request, Request, Request]:
    """"a" (7 tokens, ranked to go first) and "c" (7) decode within their second block, "b"
    (8) needs a third; the 6-block pool is full. Prefilled with a budget of 64, then
    ``budget`` tokens a step."""
    s = make(num_blocks=6, budget=64)
    a, b, c = (req("a", 7, max_tokens=3), req("b", 8, max_tokens=3, base=50),
               req("c", 7, max_tokens=3, base=100))
    a.priority = 1.0
    for r in (a, b, c):
        s.add_request(r)
    step(s)
    assert s.kv.num_free_blocks == 0
    s.max_num_batched_tokens = budget
    return s, a, b, c


def test_the_request_after_one_that_took_back_an_earlier_victim_still_runs() -> None:
    # "a" is taken back out of the step for "b": "c", behind "b" in the running list, is
    # not skipped (the index steps back with the victim gone from before it).
    s, a, _, _ = _three_decoding(budget=64)
    out = step(s)
    assert out.preempted_ids == ["a"] and a.status == RequestStatus.PREEMPTED
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1), ("c", 1)]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (2, 0)


def test_a_victim_taken_back_returns_its_tokens_to_the_budget() -> None:
    # Two tokens a step: "a" had one when it is taken back; "b" and "c" get both.
    s, _, _, _ = _three_decoding(budget=2)
    out = step(s)
    assert out.preempted_ids == ["a"]
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 1), ("c", 1)]
    assert out.num_tokens == out.num_decode_tokens == 2


def test_abort_at_any_time_frees_every_block() -> None:
    s = make(num_blocks=8, budget=6)
    s.add_request(req("a", 10))
    s.add_request(req("b", 5, base=40))
    step(s)  # a partially prefilled (6 of 10 tokens)
    assert s.kv.holds_blocks("a")
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED).status.finish_reason == "abort"
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is not None  # still waiting
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is None
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished()
    assert s.num_running == 0 and s.num_waiting == 0


@pytest.mark.parametrize("keep_session", [False, True])
def test_an_abort_keeps_the_session_only_when_asked(keep_session: bool) -> None:
    """An abort whose caller had the answer (a stop string, a settled tool call) leaves the
    computed blocks as the session's remembered prefix, as a finished request does."""
    s = make(num_blocks=8, budget=16)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=8), session_id="s")
    s.add_request(a)
    step(s)
    step(s)  # prefilled, one token decoded: 11 tokens computed, two whole blocks
    s.finish_request("a", RequestStatus.FINISHED_ABORTED, keep_session=keep_session)
    assert len(s.kv.session_block_hashes("s")) == (2 if keep_session else 0)
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished()


def test_an_answered_abort_of_a_preempted_request_keeps_the_session_prefix() -> None:
    """An answered abort of a request the scheduler had preempted (no computed blocks then)
    leaves the session's remembered prefix as it was (its last finished call's) rather than
    replace it with an empty chain."""
    s = Scheduler(KVCacheManager(4, BS), 64, 8, max_model_len=256)
    s.add_request(Request("s0", list(range(50, 58)), SamplingParams(max_tokens=1), session_id="s"))
    while s.has_unfinished():
        step(s)
    remembered = s.kv.session_block_hashes("s")
    assert len(remembered) == 2  # its prompt's two blocks
    s.add_request(Request("a", list(range(8)), SamplingParams(max_tokens=6)))
    s.add_request(Request("b", list(range(50, 58)), SamplingParams(max_tokens=6), session_id="s"))
    step(s)
    out = step(s)
    assert out.preempted_ids == ["b"] and s.requests["b"].status == RequestStatus.PREEMPTED
    s.finish_request("b", RequestStatus.FINISHED_ABORTED, keep_session=True)
    assert s.kv.session_block_hashes("s") == remembered


def test_prefix_hit_counted_on_first_admission() -> None:
    s = make(budget=64)
    s.add_request(req("a", 10))
    while s.has_unfinished():
        step(s)
    s.add_request(req("b", 12))
    out = step(s)
    assert out.scheduled[0].num_computed_tokens == 8
    assert s.requests["b"].num_cached_tokens == 8
    assert s.cached_tokens_total == 8


def test_bad_input_errors() -> None:
    s = make(num_blocks=2)
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="KV cache holds at most 8"):
        s.add_request(req("big", 6, max_tokens=10))
    with pytest.raises(ValueError):
        make(budget=0)


def check_invariants(s: Scheduler) -> None:
    refs = [0] * s.kv.num_total_blocks
    for rid, r in s.requests.items():
        blocks = s.kv.block_ids(rid)
        if r.status == RequestStatus.RUNNING:
            assert len(blocks) * BS >= r.num_computed_tokens
        else:
            assert blocks == []
        for b in blocks:
            refs[b] += 1
    assert [s.kv.pool.ref_count(b) for b in range(len(refs))] == refs
    assert s.kv.num_free_blocks == refs.count(0)
    assert len(s.running) <= s.max_num_seqs


def checked_step(s: Scheduler) -> None:
    """A step whose every scheduled request runs on blocks it holds for all its new tokens
    (a request preempted after it was scheduled would run on freed blocks)."""
    out = s.schedule()
    for x in out.scheduled:
        assert x.request.status == RequestStatus.RUNNING
        assert len(s.kv.block_ids(x.request_id)) * BS >= x.num_computed_tokens + x.num_new_tokens
    assert out.num_tokens == out.num_decode_tokens + out.num_prefill_tokens
    assert out.num_tokens <= s.max_num_batched_tokens
    s.update_after_step(out)
    for x in out.scheduled:
        r = x.request
        if x.samples:
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step"]), st.integers(0, 59))),
       st.booleans())
def test_random_workload_keeps_block_accounting(program: list[tuple[str, int]],
                                                ranked: bool) -> None:
    s = make(num_blocks=10, budget=8, max_seqs=3)
    n = 0
    for op, arg in program:
        if op == "add":
            # Three prompt families share prefixes, so prefix hits happen.
            r = req(f"r{n}", arg % 20 + 1, max_tokens=arg % 5 + 1 + 4 * ranked,
                    base=100 * (arg % 3))
            r.priority = float(arg % 4) if ranked else 0.0  # preempted largest first
            s.add_request(r)
            n += 1
        elif op == "abort" and s.requests:
            s.finish_request(
                sorted(s.requests)[arg % len(s.requests)], RequestStatus.FINISHED_ABORTED
            )
        else:
            checked_step(s)
        check_invariants(s)
    for _ in range(500):
        if not s.has_unfinished():
            break
        checked_step(s)
        check_invariants(s)
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == 10


@pytest.mark.parametrize("bad", [True, 5.0, "5", np.int64(5), None])
def test_validate_prompt_takes_exact_ints_only(bad: object) -> None:
    """A bool, float, string, numpy integer or None among the ids is refused by name, where it is
    past the checked prefix; ids before ``checked_prefix`` are not looked at."""
    with pytest.raises(ValueError, match="outside the vocabulary") as err:
        validate_prompt("r", [3, 4, bad, 5], max_model_len=10, vocab_size=8)
    assert repr(bad) in str(err.value)
    validate_prompt("r", [3, bad, 4, 5], max_model_len=10, vocab_size=8, checked_prefix=2)
    validate_prompt("r", [0, 7], max_model_len=10, vocab_size=8)
    with pytest.raises(ValueError, match="token id 8 "):
        validate_prompt("r", [0, 8], max_model_len=10, vocab_size=8)
