"""Token-level preemption's parking (Aegaeon's row): what a resume that no longer fits leaves."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sim.parking import Parking

BS = 4


def _step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_after_step(out)
    for sch in out.scheduled:
        if sch.samples:
            sch.request.output_token_ids.append(7)
    return out


def test_a_resume_that_does_not_fit_waits_and_then_finds_its_cached_prefix() -> None:
    """The parked request's blocks were freed but stay in the prefix map; when its resume
    finds too few blocks it waits holding none, so its next admission looks its prefix up
    and computes only what is missing (it recomputed from token 0 when the refused resume
    left it an empty block entry)."""
    s = Scheduler(KVCacheManager(10, BS), 32, 8, max_model_len=256)
    a = Request("a", list(range(16)), SamplingParams(max_tokens=8))
    s.add_request(a)
    _step(s)
    _step(s)  # a's prompt and one decode computed: 17 tokens, 5 blocks
    assert a.num_computed_tokens == 17
    parking = Parking()
    assert parking.park_all("m", s) == 17
    b = Request("b", list(range(100, 124)), SamplingParams(max_tokens=8))
    s.add_request(b)
    _step(s)  # b takes 6 of the 10 blocks, none of a's cached ones
    assert parking.resume_all("m", s) == 0  # a's 17 tokens need 5 blocks; 4 are free
    assert a.status == RequestStatus.PREEMPTED and not s.kv.holds_blocks("a")
    s.finish_request("b", RequestStatus.FINISHED_LENGTH)
    out = _step(s)
    (scheduled,) = [x for x in out.scheduled if x.request is a]
    assert scheduled.num_computed_tokens == 16  # its four full blocks, found again
    assert scheduled.num_new_tokens == 2  # of its 18 tokens (16 prompt, 2 output)
