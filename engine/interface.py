"""The engine seam: what the admission loop sees of an engine, live or simulated.

The live engine (torch tensors) and the simulated engine (cost model) implement the same
surface and report the same events. Every operation that takes device time returns how long
it took: the live engine reports wall seconds it measured; the simulated engine reports the
seconds its cost model predicts and does *not* sleep. The caller (talaria's executor) decides
what to do with that: nothing live (the time already passed), ``await asyncio.sleep`` in sim.
Engines never read a clock to make decisions; where one needs "now" (staging that completes
in the background), it is injected as a callable.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine.block_hash import BlockChain
from engine.sampling_params import SamplingParams
from substrate.moves import MoveRecord


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller


@dataclass
class EngineRequest:
    """One call as the engine sees it: token ids in, token ids out. Its prompt list may be
    shared with its sender (the simulated engine keeps it as is): nobody changes a prompt
    list in place (a prompt that grows is a new list)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str | None = None  # multi-model engines check it is the active model
    session_id: str | None = None  # lets the engine account / offload KV per session
    prompt_chain: BlockChain | None = None  # the prompt's hashes, when its sender has them
    # under KV pressure the running request with the largest value is preempted first, the
    # latest admitted among equals (engine.scheduler): vLLM's priority policy's order
    priority: float = 0.0


@dataclass
class TokenEvent:
    """What one step produced for one request.

    ``new_token_ids`` may be empty (a prefill chunk that did not reach the end of the
    prompt produces no event at all; a finish by abort produces an event with no tokens).
    Counts are totals so far for the request, so the last event carries the final usage.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens not prefilled: device prefix cache + restored
    num_restored_tokens: int = 0  # of those, copied back from the host KV store
    num_output_tokens: int = 0


@dataclass
class StepResult:
    events: list[TokenEvent]
    seconds: float  # measured (live) or modelled (sim) duration of the step
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Engine steps this result stands for: the simulated engine fuses consecutive
    # decode-only steps (then ``seconds`` is their sum and every running request gets up to
    # ``num_steps`` tokens); an engine reports 0 when nothing ran (the admission loop backs
    # off, and its deadlock guard makes a pin yield when calls wait with none running).
    num_steps: int = 1


# A byte movement (weights or KV) and how long it took (measured live, modelled in sim):
# ``kind`` is one of ``substrate.moves.MoveKind`` (or the sim's reload), ``bytes``, ``seconds``.
# The substrate's own record, so what it reports crosses the seam unconverted.
MoveReport = MoveRecord


@dataclass(frozen=True)
class ModelLimits:
    """What a prompt must satisfy for one model: fewer than ``max_model_len`` tokens (one
    must be left to generate), every id in ``[0, vocab_size)``."""

    max_model_len: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.max_model_len < 2 or self.vocab_size < 1:
            raise ValueError(f"bad model limits {self}")


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0  # free but still holding a prefix (reusable)
    num_total_blocks: int = 0
    block_size: int = 16
    prefill_tokens_total: int = 0
    cached_tokens_total: int = 0
    restored_tokens_total: int = 0
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class EngineCoreProtocol(Protocol):
    """Single-model engine core: what ``engine.LLM`` drives and the server wraps."""

    def add_request(self, request: EngineRequest) -> None: ...

    def step(self) -> StepResult: ...

    def abort(self, request_id: str, keep_session: bool = False) -> None: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...


class Residency(enum.StrEnum):
    """Where a model's weights are on an instance."""

    ACTIVE = "active"  # in the weight region: requests can run
    STAGED = "staged"  # complete copy in the device staging region: activation is D2D
    STAGING = "staging"  # a background host->staging copy is in progress
    HOST = "host"  # only in the host weight store: activation is H2D
    ABSENT = "absent"  # not loaded anywhere on this instance


@runtime_checkable
class MultiModelEngineProtocol(EngineCoreProtocol, Protocol):
    """An engine holding a catalog of models on one device arena, one active at a time.

    Life cycle of session KV (the admission loop drives it; the engine only executes):
    - while a request runs, its blocks are referenced by it;
    - when it finishes, its full blocks stay in the device prefix cache (free, evictable,
      LRU) and the engine remembers the session's block-hash chain;
    - ``pin_session_kv`` takes a reference on the session's cached blocks so they cannot be
      evicted (a soft reservation); ``unpin_session_kv`` gives it back;
    - ``offload_kv`` copies sessions' cached blocks to the host KV store (keyed by
      (model, block hash)); a later request of the same model restores the longest prefix
      found there into fresh device blocks instead of prefilling it;
    - ``activate`` of another model requires no running requests; it drops every device
      block of the outgoing model (pins included) — offload first to keep them.
    """

    simulated: bool

    @property
    def model_names(self) -> list[str]: ...

    @property
    def active_model(self) -> str | None: ...

    def model_limits(self) -> dict[str, ModelLimits]:
        """Each model's prompt limits (the checks ``add_request`` applies)."""
        ...

    def kv_bytes_per_token(self, model: str) -> float:
        """Bytes of KV one token of ``model`` takes on this rank (all layers, K and V)."""
        ...

    def activate(self, model: str, lend_staging: bool = False) -> MoveReport:
        """Make ``model`` active (see above). ``lend_staging``: until the next activation its
        KV cache spans the staging region too, whatever was staged there is dropped, and
        nothing can be staged (ValueError without a staging region, before anything moves).
        Activating the active model moves nothing and leaves lending as it is, except to
        lend a region not lent yet (a slot that meets KV pressure after it opened): with no
        unfinished request, its KV cache is re-viewed over both regions, nothing copied and
        its device KV dropped as at a switch (offload first); RuntimeError with one."""
        ...

    def kv_capacity_blocks(self, model: str, lent: bool = False) -> int:
        """Device KV blocks ``model`` gets while active (``lent``: with the staging region
        lent to its KV cache; as many as without when there is none)."""
        ...

    def stage(self, model: str) -> MoveReport:
        """Start copying ``model`` into the staging region; ``seconds`` is the time until
        it is ready (measured when the copy is synchronous, predicted otherwise). A copy
        that fails in the background stages nothing (the model is HOST again); an engine
        whose copies can fail so tells of each once through an optional
        ``take_staging_failures() -> list[str]`` (the live engine's)."""
        ...

    def residency(self) -> dict[str, Residency]: ...

    def can_stage(self, model: str) -> bool:
        """Whether ``model``'s weights fit the staging region (False without one)."""
        ...

    def offload_kv(self, session_ids: list[str] | None = None) -> MoveReport:
        """Copy the active model's cached KV of these sessions (None: all) to host."""
        ...

    def pin_session_kv(self, session_id: str) -> int:
        """Protect the session's device KV from eviction; returns blocks pinned."""
        ...

    def unpin_session_kv(self, session_id: str) -> None: ...

    def session_kv_tokens(self, session_id: str) -> tuple[int, int]:
        """(tokens of the session's last prefix cached on device, tokens in host store)."""
        ...

    def forget_session(self, session_id: str) -> None:
        """Drop what the engine remembers of a session (its pin, its prefix chain): its
        blocks stay cached until evicted, reachable by prefix, no longer by session."""
        ...
