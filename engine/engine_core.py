"""The single-model engine core: ``add_request`` / ``step`` / ``abort`` (EngineCoreProtocol).

Token ids in, token ids out; detokenisation is the caller's, except for stop strings: when
the core is given a tokenizer, requests with stop strings get an incremental detokenizer
and finish when their output text contains one (the token completing it is the last
output token). Without a tokenizer, stop strings are ignored (stop token ids still work).

``EngineRequest.model`` is not checked here (one model per core; multi-model engines check
it). Every request's blocks are freed when it finishes, is aborted or fails validation; an
abort produces an event with no tokens in the next ``step``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.config import EngineConfig
from engine.detokenizer import StopStringWatcher
from engine.interface import EngineRequest, EngineStats, StepResult, TokenEvent
from engine.kv_cache_manager import KVCacheManager, SecondaryKVCache
from engine.model_runner import ModelRunner
from engine.models.checkpoint_cache import model_dir
from engine.request import Request, RequestStatus, token_event, validate_forced_ids, validate_prompt
from engine.scheduler import Scheduler

log = structlog.get_logger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: ModelRunner | None = None,
        tokenizer: Any = None,
        eos_token_ids: list[int] | None = None,
        kv_cache: torch.Tensor | None = None,
        secondary: SecondaryKVCache | None = None,
    ) -> None:
        started = runner is None  # then this core starts (and, on a failure, stops) it
        if started:
            config = dataclasses.replace(config, model=model_dir(config.model))
        self.config = config
        if runner is None and config.tensor_parallel_size > 1:
            from engine.parallel.tp_runner import start_tensor_parallel

            runner = start_tensor_parallel(config, kv_cache)  # type: ignore[assignment]
        self.runner = runner if runner is not None else ModelRunner.from_config(config, kv_cache)
        try:
            self._build(config, tokenizer, eos_token_ids, secondary)
        except BaseException:
            if started:  # its tensor-parallel workers (nothing to stop at TP=1)
                self.shutdown()
            raise

    def _build(
        self,
        config: EngineConfig,
        tokenizer: Any,
        eos_token_ids: list[int] | None,
        secondary: SecondaryKVCache | None,
    ) -> None:
        """Everything but the runner, whose workers a failure here must stop."""
        hf_config = self.runner.hf_config
        model_max = getattr(hf_config, "max_position_embeddings", None)
        if config.max_model_len is not None:
            if model_max is not None and config.max_model_len > model_max:
                raise ValueError(
                    f"max_model_len {config.max_model_len} exceeds the model's "
                    f"max_position_embeddings {model_max}"
                )
            self.max_model_len = config.max_model_len
        elif model_max is not None:
            self.max_model_len = int(model_max)
        else:
            raise ValueError("max_model_len is required: the model config names no maximum")
        if (config.cuda_graphs and isinstance(self.runner, ModelRunner)
                and self.runner.device.type == "cuda"):
            self.runner.use_decode_graphs(config.max_num_seqs,
                                          -(-self.max_model_len // config.block_size))
        self.tokenizer = tokenizer
        self.eos_token_ids = set(
            eos_token_ids
            if eos_token_ids is not None
            else _eos_ids(hf_config, config.model, tokenizer)
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            secondary=secondary,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self._generators: dict[str, torch.Generator] = {}
        self._stop_watchers: dict[str, StopStringWatcher] = {}
        self._pending: list[TokenEvent] = []
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        validate_prompt(rid, prompt, self.max_model_len, self.vocab_size)
        validate_forced_ids(rid, request.params, self.vocab_size)
        req = Request(rid, prompt, request.params, session_id=request.session_id,
                      priority=request.priority)
        self.scheduler.add_request(req)
        if request.params.seed is not None:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(request.params.seed)
            self._generators[rid] = gen
        if self.tokenizer is not None and request.params.stop:
            self._stop_watchers[rid] = StopStringWatcher(self.tokenizer, prompt, request.params.stop)

    def abort(self, request_id: str, keep_session: bool = False) -> None:
        """Abort a waiting or running request, freeing its blocks; unknown ids are ignored
        (the request may have finished already). ``keep_session``: its caller has the answer
        (it stopped reading at a stop string or a finished tool call), so the blocks computed
        become the session's remembered prefix, as a finished request's do, if it holds its
        prompt's KV (``engine.scheduler.remembers_session``)."""
        req = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED, keep_session)
        if req is None:
            return
        self._forget(request_id)
        self._pending.append(token_event(req, []))

    def has_unfinished(self) -> bool:
        """Whether a ``step`` has anything to do: a live request, or an event not delivered
        yet (an abort's)."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def num_live_requests(self) -> int:
        """Requests added and neither finished nor aborted (what a model switch must wait
        for; an aborted request's pending event does not count)."""
        return len(self.scheduler.requests)

    def take_pending_events(self) -> list[TokenEvent]:
        """Hand over the events not delivered yet (a core being switched out gives its
        aborts' events to whoever steps next)."""
        events, self._pending = self._pending, []
        return events

    # ---------------------------------------------------------------------- step
    def step(self) -> StepResult:
        """One forward pass. Pending abort events are taken only once it has run, first in
        the result: a step that raises leaves them for the next one."""
        start = time.perf_counter()
        events: list[TokenEvent] = []
        out = self.scheduler.schedule()
        if out.preempted_ids:
            log.debug("engine.preempted", request_ids=out.preempted_ids)
        sampled = self.runner.execute(out, self._generators)
        self.scheduler.update_after_step(out)
        for tok in sampled:
            req = self.scheduler.requests[tok.request_id]
            req.append_token(tok.token_id, tok.logprob)
            status = self._check_stop(req, tok.token_id)
            if status is not None:
                self.scheduler.finish_request(req.request_id, status)
                self._forget(req.request_id)
            events.append(
                token_event(req, [tok.token_id], [tok.logprob] if tok.logprob is not None else None)
            )
        self.prefill_tokens_total += out.num_prefill_tokens
        self.decode_tokens_total += out.num_decode_tokens
        events[:0], self._pending = self._pending, []
        return StepResult(
            events=events,
            seconds=time.perf_counter() - start,
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_steps=0 if out.is_empty else 1,  # nothing could run (e.g. blocks pinned)
        )

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        params = req.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        watcher = self._stop_watchers.get(req.request_id)
        if watcher is not None and watcher.add(token_id):
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._stop_watchers.pop(request_id, None)

    # ------------------------------------------------------------ session KV
    def pin_session_kv(self, session_id: str) -> int:
        """Protect the session's cached device blocks from eviction; returns blocks pinned."""
        return self.kv.pin_session(session_id)

    def unpin_session_kv(self, session_id: str) -> None:
        self.kv.unpin_session(session_id)

    def session_device_tokens(self, session_id: str) -> int:
        """Tokens of the session's last finished prefix still cached on the device."""
        return len(self.kv.session_block_ids(session_id)) * self.kv.block_size

    def reset_kv(self) -> None:
        """Drop every device block, pins and session memory included (a model switch), and
        manage as many blocks as the runner's KV cache now has (a switch may re-view it).
        Requires no live request (pending events hold no blocks)."""
        if self.num_live_requests:
            raise RuntimeError("cannot reset the KV cache while requests are unfinished")
        self.kv.reset(self.runner.num_blocks)

    def shutdown(self) -> None:
        """Stop what the runner started (tensor-parallel workers); a no-op at TP=1."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # --------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=self.kv.num_free_blocks,
            num_cached_blocks=self.kv.num_cached_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            block_size=self.kv.block_size,
            prefill_tokens_total=self.prefill_tokens_total,
            cached_tokens_total=self.scheduler.cached_tokens_total,
            restored_tokens_total=self.scheduler.restored_tokens_total,
            extra={
                "num_preemptions": float(self.scheduler.num_preemptions),
                "num_pinned_blocks": float(self.kv.num_pinned_blocks),
                "decode_tokens_total": float(self.decode_tokens_total),
            },
        )


def _eos_ids(hf_config: Any, model_dir: str | Path, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    found: Any = None
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        from transformers import GenerationConfig

        found = GenerationConfig.from_pretrained(model_dir).eos_token_id
    if found is None and hf_config is not None:
        found = getattr(hf_config, "eos_token_id", None)
    if found is None and tokenizer is not None:
        found = tokenizer.eos_token_id
    if found is None:
        return []
    return [int(x) for x in found] if isinstance(found, list | tuple) else [int(found)]
