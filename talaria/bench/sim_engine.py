"""Wall-time benchmark of the simulated engine on its own, without router or instances.

    .venv/bin/python -m talaria.bench.sim_engine [--batched] [--sessions 30] [--calls 32]

A trivial driver: sessions are spread over the three default models; in each round every
model in turn is activated, gets the next call of each of its sessions (one at a time, or
all at once with --batched), runs until they finish, and offloads its sessions' KV to host.
Prompts grow from ~14k to ~125k tokens, each call's prompt extending the previous prompt and
output; every call decodes 250 tokens. Prints the wall and CPU time and the modelled time.
"""

from __future__ import annotations

import argparse
import time

from engine.interface import EngineRequest
from engine.sampling_params import SamplingParams
from engine.sim.engine import SimEngine, SimEngineConfig
from engine.sim.model_spec import DEFAULT_CATALOG


class _FreshTokens:
    """Distinct-looking token ids (cheap to make: the benchmark times the engine)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        start, self.next = self.next, self.next + n
        return [t % 30000 + 1 for t in range(start * 7919, (start + n) * 7919, 7919)]


def run(num_sessions: int, num_calls: int, batched: bool, fused: int) -> dict[str, float]:
    engine = SimEngine(list(DEFAULT_CATALOG), SimEngineConfig(max_fused_decode_steps=fused))
    models = {f"s{i}": DEFAULT_CATALOG[i % len(DEFAULT_CATALOG)] for i in range(num_sessions)}
    fresh = _FreshTokens()
    prompts = {sid: fresh.take(14000) for sid in models}
    growth = (125_000 - 14_000 - num_calls * 250) // max(1, num_calls - 1)
    wall, cpu = time.perf_counter(), time.process_time()
    modelled = 0.0
    calls = 0
    for k in range(num_calls):
        for model in DEFAULT_CATALOG:
            modelled += engine.activate(model).seconds
            sids = [s for s, m in models.items() if m == model]
            groups = [sids] if batched else [[s] for s in sids]
            for group in groups:
                for sid in group:
                    engine.add_request(EngineRequest(
                        f"{sid}-{k}", prompts[sid], SamplingParams(max_tokens=250),
                        model=model, session_id=sid))
                outputs: dict[str, list[int]] = {sid: [] for sid in group}
                while engine.has_unfinished():
                    step = engine.step()
                    modelled += step.seconds
                    for ev in step.events:
                        outputs[ev.request_id.rsplit("-", 1)[0]].extend(ev.new_token_ids)
                for sid in group:
                    prompts[sid] = prompts[sid] + outputs[sid] + fresh.take(growth)
                    calls += 1
            modelled += engine.offload_kv(None).seconds
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    st = engine.stats()
    return {
        "calls": calls,
        "wall_s": wall,
        "cpu_s": cpu,
        "modelled_s": modelled,
        "prefill_tokens": st.prefill_tokens_total,
        "cached_tokens": st.cached_tokens_total,
        "restored_tokens": st.restored_tokens_total,
        "steps": st.extra["num_steps"],
        "preemptions": st.extra["num_preemptions"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=30)
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--batched", action="store_true")
    ap.add_argument("--fused", type=int, default=SimEngineConfig().max_fused_decode_steps)
    args = ap.parse_args()
    result = run(args.sessions, args.calls, args.batched, args.fused)
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in result.items()))


if __name__ == "__main__":
    main()
