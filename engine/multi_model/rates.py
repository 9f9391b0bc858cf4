"""Per-model measured rates of a live multi-model engine (what the instance reports).

Accumulated from the engine's own measurements: step results (prefill tokens per second of
steps that prefilled, seconds of decode-only steps) and move records (switch seconds from
host and from staging, staging seconds, KV restore/offload bytes per second). A rate never
measured reads 0.0 (unknown), as the instance's rate book expects. Staging copies end in the
background and are seen ending by whichever poll comes first (``StagingBook``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from engine.interface import StepResult
from substrate.moves import MoveKind, MoveRecord
from substrate.staging import StagingOutcome


@dataclass
class _Totals:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds += seconds

    @property
    def mean_s(self) -> float:
        return self.seconds / self.count if self.count else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ModelRateMeter:
    kv_bytes_per_token: float
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode: _Totals = field(default_factory=_Totals)
    moves: dict[str, _Totals] = field(default_factory=dict)

    def observe_step(self, step: StepResult) -> None:
        """A step that prefilled counts wholly as prefill time (decodes riding along are
        cheap next to a prefill chunk); a decode-only step counts as one decode step."""
        if step.num_prefill_tokens > 0:
            self.prefill_tokens += step.num_prefill_tokens
            self.prefill_seconds += step.seconds
        elif step.num_decode_tokens > 0:
            self.decode.add(0, step.seconds)

    def observe_move(self, record: MoveRecord) -> None:
        if record.kind == MoveKind.NONE or record.bytes == 0:
            return
        self.moves.setdefault(record.kind, _Totals()).add(record.bytes, record.seconds)

    def rates(self) -> dict[str, float]:
        def move(kind: str) -> _Totals:
            return self.moves.get(kind, _Totals())

        return {
            "prefill_tokens_per_s": (
                self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0
            ),
            "decode_step_s": self.decode.mean_s,
            "switch_host_s": move(MoveKind.ACTIVATE_H2D).mean_s,
            "switch_staged_s": move(MoveKind.ACTIVATE_D2D).mean_s,
            "stage_s": move(MoveKind.STAGE).mean_s,
            "kv_restore_bytes_per_s": move(MoveKind.KV_RESTORE).bytes_per_s,
            "kv_offload_bytes_per_s": move(MoveKind.KV_OFFLOAD).bytes_per_s,
            "kv_bytes_per_token": float(self.kv_bytes_per_token),
        }


class StagingBook:
    """Where the staging copies that ended go: each completed copy's record to its model's
    meter, each failed copy's model to ``take_failures``. Fed only from the substrate's
    queue of outcomes (``RankModels.take_staging_outcomes``), never from the record a poll
    returns, so every copy is metered exactly once whichever poll saw it end."""

    def __init__(self, meters: Mapping[str, ModelRateMeter]) -> None:
        self._meters = meters
        self._failed: list[str] = []

    def book(self, outcomes: Iterable[StagingOutcome]) -> None:
        for outcome in outcomes:
            if outcome.record is None:
                self._failed.append(outcome.model)
            else:
                self._meters[outcome.model].observe_move(outcome.record)

    def take_failures(self) -> list[str]:
        """The models whose background copies failed since the last call, in order."""
        failed, self._failed = self._failed, []
        return failed
