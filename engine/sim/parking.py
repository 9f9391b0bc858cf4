"""Token-level preemption in the simulated engine: park the active model's unfinished
requests (their KV copied to host, their device blocks freed) and resume them, KV copied
back, when their model is active again. Aegaeon (SOSP'25) preempts this way between decode
steps to hand the GPUs to another model; its KV swap runs at host-link rate."""

from __future__ import annotations

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

__all__ = ["Parking"]


class Parking:
    """Requests suspended per model, waiting for their model to be active again."""

    def __init__(self) -> None:
        self._by_model: dict[str, list[Request]] = {}

    def __len__(self) -> int:
        return sum(len(p) for p in self._by_model.values())

    def park_all(self, model: str, scheduler: Scheduler) -> int:
        """Take every unfinished request out of ``scheduler`` (``model``'s), freeing its
        blocks; each keeps ``num_computed_tokens``: the KV that goes to host and comes back
        on resume. Returns those tokens."""
        parked = self._by_model.setdefault(model, [])
        tokens = 0
        for request in list(scheduler.requests.values()):
            if request.status == RequestStatus.RUNNING:
                scheduler.running.remove(request)
            else:
                scheduler.waiting.remove(request)
            del scheduler.requests[request.request_id]
            scheduler.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            parked.append(request)
            tokens += request.num_computed_tokens
        return tokens

    def resume_all(self, model: str, scheduler: Scheduler) -> int:
        """Put ``model``'s parked requests into its freshly activated ``scheduler`` as
        running, their KV restored into new blocks; returns the tokens restored. A request
        whose KV no longer fits waits to be recomputed (as a recompute preemption would)."""
        restored = 0
        for request in self._by_model.pop(model, []):
            computed = request.num_computed_tokens
            request.num_computed_tokens = 0
            scheduler.requests[request.request_id] = request
            if computed and scheduler.kv.allocate_slots(request, computed):
                request.num_computed_tokens = computed
                scheduler.kv.cache_computed_blocks(request)
                request.status = RequestStatus.RUNNING
                scheduler.running.append(request)
                restored += computed
            else:
                request.status = RequestStatus.PREEMPTED
                scheduler.waiting.append(request)
        return restored

    def abort(self, request_id: str) -> Request | None:
        """Drop a parked request (aborted by its caller); None if none is parked so."""
        for parked in self._by_model.values():
            for request in parked:
                if request.request_id == request_id:
                    parked.remove(request)
                    request.status = RequestStatus.FINISHED_ABORTED
                    return request
        return None
