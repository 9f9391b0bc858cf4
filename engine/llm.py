"""Offline batch generation for research scripts: ``LLM(path).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.detokenizer import output_text
from engine.engine_core import EngineCore
from engine.interface import EngineRequest, FinishReason
from engine.sampling_params import SamplingParams


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    logprobs: list[float] | None = None
    num_restored_tokens: int = 0


class LLM:
    """One model on one device, or over ``tensor_parallel_size`` ranks (worker processes
    started here, stopped by ``shutdown`` or at interpreter exit). ``model`` is a Hugging
    Face directory or a GGUF file (converted once into the cache). Prompts are strings
    (tokenized with the model's tokenizer, special tokens added) or lists of token ids."""

    def __init__(self, model: str | Path, **engine_args: Any) -> None:
        """``engine_args``: any field of ``EngineConfig`` but ``model`` (its defaults are the
        LLM's; ``kv_cache_blocks`` is ``num_kv_blocks``). TypeError names an unknown one."""
        from transformers import AutoTokenizer

        from engine.models.checkpoint_cache import model_dir

        if "kv_cache_blocks" in engine_args:
            engine_args["num_kv_blocks"] = engine_args.pop("kv_cache_blocks")
        known = {f.name for f in fields(EngineConfig)} - {"model"}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine argument(s) {unknown}; EngineConfig "
                            f"takes {sorted(known)}")
        model = model_dir(model)  # a .gguf file: its converted directory
        if not (model / "config.json").is_file():  # before the tokenizer, which asks the Hub
            raise FileNotFoundError(f"no config.json in model directory {str(model)!r}")
        self.config = EngineConfig(model=model, **engine_args)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.core: EngineCore | None = EngineCore(self.config, tokenizer=self.tokenizer)
        self._counter = 0

    @property
    def engine(self) -> EngineCore:
        if self.core is None:
            raise RuntimeError("this LLM has been shut down")
        return self.core

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; outputs are in prompt order. ``params``: one for all,
        or a list (or tuple) of one per prompt."""
        core = self.engine
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        if params is None:
            params = SamplingParams()
        param_list = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        wrong = [type(p).__name__ for p in param_list if not isinstance(p, SamplingParams)]
        if wrong:
            raise TypeError("params must be a SamplingParams or a list of them, one per prompt; "
                            f"got {wrong[0]}")
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} sampling params")
        token_lists = [self._tokens(p) for p in prompts]

        ids: list[str] = []
        try:
            for i, (tokens, p) in enumerate(zip(token_lists, param_list, strict=True)):
                rid = f"llm-{self._counter}"
                self._counter += 1
                try:
                    core.add_request(EngineRequest(rid, tokens, p))
                except ValueError as err:  # its request id is not one the caller knows
                    raise ValueError(f"prompts[{i}]: {err}") from err
                ids.append(rid)
            results = self._run(core, ids)
        except BaseException:
            for rid in ids:
                core.abort(rid)
            while core.has_unfinished():
                core.step()
            raise
        return [
            self._output(rid, tokens, p, results[rid])
            for rid, tokens, p in zip(ids, token_lists, param_list, strict=True)
        ]

    def shutdown(self) -> None:
        """Stop the engine (and its tensor-parallel workers); idempotent."""
        if self.core is not None:
            self.core.shutdown()
        self.core = None

    # ------------------------------------------------------------------ helpers
    def _tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list):
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt)}")

    def _is_stop_token(self, token_id: int, params: SamplingParams) -> bool:
        """Whether ``token_id`` ends a request as a stop token (an EOS id unless
        ``ignore_eos``, or one of ``stop_token_ids``). The core checks these before stop
        strings, so a request finished by STOP whose last token is one was stopped by it.
        Its text is not part of the output text, as in vLLM (which keeps it out unless
        ``include_stop_str_in_output``); its id stays in ``token_ids``."""
        if token_id in params.stop_token_ids:
            return True
        return not params.ignore_eos and token_id in self.engine.eos_token_ids

    @staticmethod
    def _run(core: EngineCore, ids: list[str]) -> dict[str, dict]:
        wanted = set(ids)
        results: dict[str, dict] = {
            rid: {"tokens": [], "logprobs": [], "event": None} for rid in ids
        }
        while wanted:
            step = core.step()
            if not step.events and step.num_prefill_tokens + step.num_decode_tokens == 0:
                raise RuntimeError(
                    "the engine made no progress: too few free KV blocks for any waiting "
                    "request (are blocks pinned?)"
                )
            for ev in step.events:
                if ev.request_id not in results:
                    continue
                r = results[ev.request_id]
                r["tokens"].extend(ev.new_token_ids)
                if ev.logprobs:
                    r["logprobs"].extend(ev.logprobs)
                if ev.finished:
                    r["event"] = ev
                    wanted.discard(ev.request_id)
        return results

    def _output(
        self, rid: str, prompt: list[int], params: SamplingParams, r: dict
    ) -> GenerationOutput:
        ev = r["event"]
        tokens = r["tokens"]
        if ev.finish_reason == FinishReason.STOP and self._is_stop_token(tokens[-1], params):
            tokens = tokens[:-1]
        text = output_text(self.tokenizer, prompt, tokens, params.stop)
        return GenerationOutput(
            request_id=rid,
            prompt_token_ids=prompt,
            token_ids=r["tokens"],
            text=text,
            finish_reason=ev.finish_reason,
            num_prompt_tokens=ev.num_prompt_tokens,
            num_cached_tokens=ev.num_cached_tokens,
            num_generated_tokens=ev.num_output_tokens,
            logprobs=r["logprobs"] if params.logprobs else None,
            num_restored_tokens=ev.num_restored_tokens,
        )
