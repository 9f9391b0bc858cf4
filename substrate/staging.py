"""Staging: copy the next model's shard from host into the device staging region in the
background while the active model keeps running.

On CUDA the copy runs on a side stream (which first waits for the current stream, so it never
overwrites staging bytes an earlier activation is still reading) and completion is a CUDA
event; on CPU it runs in a thread. Activating a staged model is then a device-to-device copy
(``TorchMover.activate_from_staging``) after ``wait()``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from substrate.ledger import StagingState
from substrate.moves import MoveKind, MoveRecord

__all__ = ["Stager", "StagingOutcome", "StagingState"]


@dataclass(frozen=True)
class StagingOutcome:
    """How one background staging copy of ``model`` ended: ``record`` (kind "stage", the
    bytes, the seconds the copy took) when it completed, None when it failed (it staged
    nothing: the model activates from host)."""

    model: str
    record: MoveRecord | None

    @property
    def failed(self) -> bool:
        return self.record is None


class Stager:
    """One background copy at a time into ``staging_region`` (a flat uint8 device tensor).

    The source buffer must stay alive and unchanged until the copy is READY (the host weight
    store keeps its buffers for the life of the model).
    """

    def __init__(self, staging_region: torch.Tensor) -> None:
        self.region = staging_region
        self.device = staging_region.device
        self._model: str | None = None
        self._nbytes = 0
        self._state = StagingState.NONE
        self._record: MoveRecord | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cpu_seconds = 0.0
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._done_event = torch.cuda.Event(enable_timing=True)

    @property
    def capacity_bytes(self) -> int:
        return self.region.numel()

    @property
    def model(self) -> str | None:
        """The model being staged or staged (None when the state is NONE)."""
        return self._model

    @property
    def state(self) -> StagingState:
        if self._state is StagingState.IN_PROGRESS and self._finished():
            self._complete()
        return self._state

    def is_ready(self, model: str) -> bool:
        return self._model == model and self.state is StagingState.READY

    def start(self, model: str, host_buffer: torch.Tensor, nbytes: int) -> None:
        """Begin copying the first ``nbytes`` of ``host_buffer`` into the staging region.
        A copy already in progress is waited for first; the previous content is replaced."""
        if nbytes > self.capacity_bytes:
            raise ValueError(
                f"{model}: {nbytes} bytes do not fit the staging region of "
                f"{self.capacity_bytes} bytes"
            )
        if nbytes > host_buffer.numel():
            raise ValueError(
                f"{model}: {nbytes} bytes asked from a {host_buffer.numel()}-byte buffer"
            )
        if self._state is StagingState.IN_PROGRESS:
            self.wait()
        self._model, self._nbytes = model, nbytes
        self._record, self._error = None, None
        self._state = StagingState.IN_PROGRESS
        dst, src = self.region[:nbytes], host_buffer[:nbytes]
        if self.device.type == "cuda":
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._start_event.record(self._stream)
                dst.copy_(src, non_blocking=True)
                self._done_event.record(self._stream)
        else:
            self._thread = threading.Thread(
                target=self._cpu_copy, args=(dst, src), name=f"stage-{model}", daemon=True
            )
            self._thread.start()

    def wait(self) -> MoveRecord | None:
        """Block until the current copy is done; its record (kind "stage", bytes, seconds
        the copy itself took), or None when nothing is staged. A failed copy leaves the state
        NONE and is re-raised here, once, as RuntimeError."""
        if self._state is StagingState.IN_PROGRESS:
            if self.device.type == "cuda":
                self._done_event.synchronize()
            elif self._thread is not None:
                self._thread.join()
            self._complete()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"staging copy failed: {error}") from error
        return self._record

    def invalidate(self) -> None:
        """Forget the staged content (waits for a copy in progress to end first, and
        re-raises its failure)."""
        if self._state is StagingState.IN_PROGRESS:
            self.wait()
        self._error = None
        self._model, self._nbytes, self._record = None, 0, None
        self._state = StagingState.NONE

    def _cpu_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        start = time.perf_counter()
        try:
            dst.copy_(src)
        except BaseException as exc:  # surfaced by wait() in the caller's thread
            self._error = exc
        self._cpu_seconds = time.perf_counter() - start

    def _finished(self) -> bool:
        if self.device.type == "cuda":
            return self._done_event.query()
        return self._thread is None or not self._thread.is_alive()

    def _complete(self) -> None:
        if self.device.type == "cuda":
            seconds = self._start_event.elapsed_time(self._done_event) / 1000.0
        else:
            self._thread = None
            seconds = self._cpu_seconds
        if self._error is not None:
            self._model, self._nbytes, self._state = None, 0, StagingState.NONE
            return
        self._record = MoveRecord(MoveKind.STAGE, self._nbytes, seconds)
        self._state = StagingState.READY
