"""Tensor parallelism on CPU (gloo): 2 ranks give the same logits as one.

The case covers vocabulary padding (509 tokens over 2 ranks), a KV head replicated across
ranks (1 KV head, 2 ranks), row-parallel all-reduces and the MoE all-reduce.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from helpers import Step, ToyBlocks, allocate_kv_cache, batch_inputs

from engine.attention.torch_paged import TorchPagedAttention
from engine.models.loader import load_checkpoint
from engine.models.registry import build_model
from engine.models.tiny import write_random_checkpoint
from engine.parallel_context import SINGLE, ParallelContext

WORLD_SIZE = 2


def _logits(path: Path, parallel: ParallelContext) -> torch.Tensor:
    config = transformers.AutoConfig.from_pretrained(path)
    model = build_model(config, torch.float32, parallel, TorchPagedAttention())
    load_checkpoint(model, path)
    num_layers, kv_heads, head_dim = model.kv_cache_spec()
    kv = allocate_kv_cache(num_layers, 16, 4, kv_heads, head_dim)
    blocks = ToyBlocks(16, 4)
    outs = []
    with torch.no_grad():
        for steps in (
            [Step(0, list(range(5, 15)), 0), Step(1, list(range(20, 27)), 0)],
            [Step(0, [3], 10), Step(1, [4], 7)],
        ):
            ids, positions, meta, rows = batch_inputs(steps, blocks)
            logits = model.compute_logits(model(ids, positions, meta, kv))
            outs.extend(logits[row] for row in rows)
    return torch.cat(outs)


def _worker(rank: int, port: int, path: Path, queue: mp.Queue) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    out = _logits(path, ParallelContext(rank, WORLD_SIZE, dist.group.WORLD))
    queue.put((rank, out.tolist()))
    dist.barrier()  # both ranks are past their last collective
    queue.close()
    queue.join_thread()
    # Leave without gloo's teardown: it aborted a worker now and then at exit ("terminate
    # called without an active exception", exit -6) after its logits were sent. A failure
    # before this line exits non-zero and sends nothing.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_tensor_parallel_matches_single_rank(tmp_path: Path) -> None:
    path = write_random_checkpoint(
        tmp_path / "m",
        "mixtral",
        seed=3,
        initializer_range=0.1,
        vocab_size=509,
        num_key_value_heads=1,
    )
    expected = _logits(path, SINGLE)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, path, queue)) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in range(WORLD_SIZE):
        out = torch.tensor(results[rank])
        assert out.shape == expected.shape == (19, 509)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)
