"""An answered abort (``keep_session``) of a request the scheduler had preempted: it holds no
computed blocks then, so it leaves the session's remembered prefix as it was (its last
finished call's) rather than replace it with an empty chain."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def _step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_after_step(out)
    for sch in out.scheduled:
        if sch.samples:
            r = sch.request
            r.output_token_ids.append(7)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    return out


def test_an_answered_abort_of_a_preempted_request_keeps_the_session_prefix() -> None:
    s = Scheduler(KVCacheManager(4, BS), 64, 8, max_model_len=256)
    s.add_request(Request("s0", list(range(50, 58)), SamplingParams(max_tokens=1), session_id="s"))
    while s.has_unfinished():
        _step(s)
    remembered = s.kv.session_block_hashes("s")
    assert len(remembered) == 2  # its prompt's two blocks
    s.add_request(Request("a", list(range(8)), SamplingParams(max_tokens=6)))
    s.add_request(Request("b", list(range(50, 58)), SamplingParams(max_tokens=6), session_id="s"))
    _step(s)
    out = _step(s)
    assert out.preempted_ids == ["b"] and s.requests["b"].status == RequestStatus.PREEMPTED
    s.finish_request("b", RequestStatus.FINISHED_ABORTED, keep_session=True)
    assert s.kv.session_block_hashes("s") == remembered
