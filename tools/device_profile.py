"""Where the live engine's GPU step goes (a device session's profile, after
``tools/device_check.sh`` found the step overhead-bound): the host syncs one decode step
makes (``torch.cuda.set_sync_debug_mode``: each warning names the Python line that waited),
then the profiler's top operators by host and by device time over a few decode steps and
one long prefill of the Llama-1B-shaped model in bfloat16 (eager); first, decode step times
eager and replayed from CUDA graphs (``engine.graphs.decode``).

Run: ``PYTHONPATH=. python3 tools/device_profile.py``.
"""

from __future__ import annotations

import collections
import time
import warnings
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.interface import EngineRequest
from talaria.bench.device_steps import write_llama_1b_shape
from talaria.paths import cache_dir


def decoding(path: Path, batch: int, context: int, cuda_graphs: bool) -> LLM:
    """An engine whose ``batch`` requests of ``context`` prompt tokens all decode now."""
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_num_seqs=64,
              cuda_graphs=cuda_graphs)
    core = llm.engine
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineRequest(
            f"p{i}", [7 + (i * 13 + j) % 30000 for j in range(context)], params))
    while any(r.num_output_tokens < 8 for r in core.scheduler.requests.values()):
        core.step()
    return llm


def step_ms(llm: LLM, steps: int = 10) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    path = write_llama_1b_shape(cache_dir() / "bench")
    for batch, context in ((1, 512), (32, 256), (64, 2048)):
        times = {}
        for graphs in (False, True):
            llm = decoding(path, batch, context, graphs)
            times[graphs] = step_ms(llm)
            llm.shutdown()
        print(f"decode step, batch {batch} x {context}: eager {times[False]:.1f} ms, "
              f"CUDA graphs {times[True]:.1f} ms (x{times[False] / times[True]:.2f})", flush=True)
    llm = decoding(path, 32, 256, cuda_graphs=False)
    core = llm.engine

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        core.step()
    torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught)
    print(f"host syncs in one decode step: {len(caught)}")
    for line, n in where.most_common(20):
        print(f"  {n:4d}  {line}")

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(4):
            core.step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(averages.table(sort_by="self_device_time_total", row_limit=15,
                         max_name_column_width=60))
    while core.has_unfinished():
        core.step()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    core.add_request(EngineRequest("long", [11 + j % 30000 for j in range(4096)], one))
    with torch.profiler.profile(activities=activities) as prof:
        while core.has_unfinished():
            core.step()
        torch.cuda.synchronize()
    print("prefill of 4096 tokens:")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15,
                                    max_name_column_width=60))
    llm.shutdown()


if __name__ == "__main__":
    main()
