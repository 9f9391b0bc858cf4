"""Benchmark of the live multi-model engine on the "small" random models.

Measures, on this machine's device:
- a model switch from the host weight store (H2D) and from the staging region (D2D), as
  achieved bytes/s against a plain torch copy of the same size between preallocated tensors
  (host -> device and device -> device respectively; the goal is a ratio >= 0.8);
- for each prefix length, restoring a session's KV from the host store after a switch away
  and back, against recomputing it (prefilling the same prefix from scratch), as a ratio.

Each switch time is the best of ``repeats``; each prefill and restore is measured once.
``bench_multi_model`` prints nothing; ``main`` prints its result as JSON.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import orjson
import torch

from engine.interface import EngineRequest, MoveReport
from engine.model_runner import resolve_device
from engine.models.tiny import write_random_checkpoint
from engine.multi_model.catalog import read_catalog
from engine.multi_model.engine import MultiModelConfig, MultiModelEngine
from engine.sampling_params import SamplingParams
from substrate.mover import TorchMover

MODEL, OTHER = "bench-llama", "bench-qwen3"
PROMPT_VOCAB = 512  # prompt token ids are drawn below this (every model size has more)


def write_bench_models(
    directory: Path, max_position_embeddings: int, size: str = "small"
) -> dict[str, Path]:
    """A llama and a qwen3 of ``size`` (the qwen3 reuses the llama's tokenizer), with room
    for long prefixes."""
    from transformers import AutoTokenizer

    first = write_random_checkpoint(
        directory / MODEL, "llama", size=size, max_position_embeddings=max_position_embeddings
    )
    second = write_random_checkpoint(
        directory / OTHER,
        "qwen3",
        size=size,
        tokenizer=AutoTokenizer.from_pretrained(first),
        max_position_embeddings=max_position_embeddings,
    )
    return {MODEL: first, OTHER: second}


def _best(reports: list[MoveReport]) -> MoveReport:
    return min(reports, key=lambda r: r.seconds)


def _plain_copies(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Best seconds of a plain host->device and device->device copy of ``nbytes``."""
    pinned = device.type == "cuda"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev_src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    mover = TorchMover(device)
    out: dict[str, float] = {}
    for label, src in (("h2d", host), ("d2d", dev_src)):
        runs = [
            mover.timed(label, nbytes, lambda s=src: dev_dst.copy_(s, non_blocking=True))
            for _ in range(repeats + 1)
        ]
        out[label] = min(r.seconds for r in runs[1:])
    return out


def _run(engine: MultiModelEngine, request: EngineRequest) -> tuple[float, int, int]:
    """(step seconds, prefill tokens, restored tokens) of one request run to completion."""
    engine.add_request(request)
    seconds, prefilled, restored = 0.0, 0, 0
    while engine.has_unfinished():
        step = engine.step()
        seconds += step.seconds
        prefilled += step.num_prefill_tokens
        for ev in step.events:
            restored = max(restored, ev.num_restored_tokens)
    return seconds, prefilled, restored


def bench_switch(engine: MultiModelEngine, repeats: int) -> dict[str, object]:
    nbytes = engine.catalog[MODEL].layout.total_bytes
    host, staged = [], []
    for _ in range(repeats + 1):
        engine.stage(OTHER)  # evicts MODEL from staging: its next activation is H2D
        engine.activate(OTHER)
        host.append(engine.activate(MODEL))
        engine.activate(OTHER)
        engine.stage(MODEL)
        staged.append(engine.activate(MODEL))
    if {r.kind for r in host} != {"activate_h2d"} or {r.kind for r in staged} != {"activate_d2d"}:
        raise RuntimeError("bench_multi_model: a switch did not take the expected path")
    plain = _plain_copies(nbytes, engine.device, repeats)
    best_host, best_staged = _best(host[1:]), _best(staged[1:])
    return {
        "bytes": nbytes,
        "host_s": best_host.seconds,
        "host_gb_per_s": best_host.bytes_per_s / 1e9,
        "plain_h2d_s": plain["h2d"],
        "host_vs_plain": plain["h2d"] / best_host.seconds,
        "staged_s": best_staged.seconds,
        "staged_gb_per_s": best_staged.bytes_per_s / 1e9,
        "plain_d2d_s": plain["d2d"],
        "staged_vs_plain": plain["d2d"] / best_staged.seconds,
    }


def bench_restore(engine: MultiModelEngine, prefix_len: int, seed: int) -> dict[str, float]:
    """Prefill a ``prefix_len`` prompt (recompute time), offload, switch away and back,
    then continue the session: the restore's bytes and seconds against the recompute."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, PROMPT_VOCAB, (prefix_len,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sid = f"bench-{prefix_len}"
    engine.activate(MODEL)
    recompute_s, prefilled, _ = _run(engine, EngineRequest(f"{sid}-1", prefix, params, MODEL, sid))
    offload = engine.offload_kv([sid])
    engine.activate(OTHER)
    engine.activate(MODEL)
    engine.take_restore_reports()
    suffix = torch.randint(3, PROMPT_VOCAB, (16,), generator=g).tolist()
    cont = EngineRequest(f"{sid}-2", prefix + suffix, params, MODEL, sid)
    cont_s, cont_prefilled, restored = _run(engine, cont)
    restores = engine.take_restore_reports()
    restore_s = sum(r.seconds for r in restores)
    restore_bytes = sum(r.bytes for r in restores)
    return {
        "prefix_tokens": prefix_len,
        "recompute_s": recompute_s,
        "recompute_tokens": prefilled,
        "offload_s": offload.seconds,
        "offload_bytes": offload.bytes,
        "restored_tokens": restored,
        "restore_s": restore_s,
        "restore_bytes": restore_bytes,
        "restore_gb_per_s": restore_bytes / restore_s / 1e9 if restore_s > 0 else 0.0,
        "restore_vs_recompute": restore_s / recompute_s,
        "continuation_s": cont_s,
        "continuation_prefilled_tokens": cont_prefilled,
    }


def bench_multi_model(
    device: str | None = None,
    prefix_lens: tuple[int, ...] = (4096, 16384),
    repeats: int = 3,
    max_num_batched_tokens: int | None = None,
    model_dir: str | Path | None = None,
    size: str = "small",
    threads: int | None = None,
) -> dict[str, object]:
    """Switch and KV-restore measurements (see module doc) on freshly written models of
    ``size`` (under ``model_dir``, or a temporary directory). ``threads`` sets torch's
    intra-op threads for the run (restored after): on a CPU shared with other processes,
    1 avoids the thread-pool stalls that otherwise dominate small copies."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(device, prefix_lens, repeats, max_num_batched_tokens, model_dir, size)
    finally:
        torch.set_num_threads(previous)


def _bench(
    device: str | None,
    prefix_lens: tuple[int, ...],
    repeats: int,
    max_num_batched_tokens: int | None,
    model_dir: str | Path | None,
    size: str,
) -> dict[str, object]:
    if repeats < 1 or not prefix_lens or min(prefix_lens) < 1:
        raise ValueError(
            f"need repeats >= 1 and positive prefix lengths, got {repeats}, {prefix_lens}"
        )
    dev = resolve_device(device or "auto")
    block = 16
    longest = max(prefix_lens) + 64
    batch = max_num_batched_tokens or (8192 if dev.type == "cuda" else 1024)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(model_dir) if model_dir is not None else Path(tmp)
        start = time.perf_counter()
        paths = write_bench_models(directory, longest + 64, size)
        num_blocks = -(-longest // block) + 4
        catalog = read_catalog(paths, "float32", block, load_tokenizers=False)
        kv_per_token = max(entry.kv_bytes_per_token for entry in catalog.values())
        engine = MultiModelEngine(
            paths,
            MultiModelConfig(
                device=str(dev),
                dtype="float32",
                block_size=block,
                num_kv_blocks=num_blocks,
                host_kv_bytes=int(2 * kv_per_token * longest),
                max_num_batched_tokens=batch,
                max_num_seqs=4,
                wait_for_staging=True,
                load_tokenizers=False,
            ),
        )
        setup_s = time.perf_counter() - start
        result: dict[str, object] = {
            "device": str(dev),
            "model": MODEL,
            "size": size,
            "torch_threads": torch.get_num_threads(),
            "weight_bytes": engine.catalog[MODEL].layout.total_bytes,
            "kv_bytes_per_token": engine.catalog[MODEL].kv_bytes_per_token,
            "max_num_batched_tokens": batch,
            "setup_s": setup_s,
            "switch": bench_switch(engine, repeats),
        }
        result["restore"] = [
            bench_restore(engine, n, seed=i) for i, n in enumerate(sorted(prefix_lens))
        ]
        result["model_rates"] = engine.model_rates(MODEL)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default=None)
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--size", default="small")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    result = bench_multi_model(
        args.device,
        tuple(args.prefix_lens),
        args.repeats,
        args.max_num_batched_tokens,
        size=args.size,
        threads=args.threads,
    )
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
