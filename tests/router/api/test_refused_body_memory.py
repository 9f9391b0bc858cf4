"""A body refused while it is read (over ``max_body_bytes``: 413; one its Content-Encoding
does not decode: 400) is freed when its answer goes out. It was kept in a reference cycle
(the exception, its traceback, the frame of ``asyncio.wait_for`` holding the read's future,
which holds the exception) until the interpreter's cyclic collector next ran, which large
buffers do not hasten: driving `talaria serve` by hand, each 200 KB gzip body that inflates
past the limit added about 175 MB to the router's memory, 2.6 GB after 15 of them."""

from __future__ import annotations

import asyncio
import gc
import gzip
import tracemalloc
from collections.abc import Iterator

import pytest
from api_helpers import reply, serve
from router_fakes import FakeInstance

from router.tokenization import ModelTokenizer

LIMIT = 2 * 1024 * 1024


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic collector off (so only reference counting frees), memory traced."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
        gc.enable()


def _body(size: int) -> bytes:
    return b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * size + b'"}]}'


@pytest.mark.parametrize(("encoding", "status"), [(None, 413), ("gzip", 413), ("bad-gzip", 400)])
async def test_a_refused_body_is_freed_with_its_answer(
    tokenizer: ModelTokenizer, no_cyclic_gc: None, encoding: str | None, status: int,
) -> None:
    a = FakeInstance("a", reply(tokenizer))
    headers = {"Content-Type": "application/json"}
    data = _body(3 * LIMIT)
    if encoding is not None:
        headers["Content-Encoding"] = "gzip"
        data = gzip.compress(data) if encoding == "gzip" else data
    async with serve(tokenizer, {"a": a}, max_body_bytes=LIMIT) as client:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            resp = await client.post("/v1/chat/completions", data=data, headers=headers)
            assert resp.status == status, await resp.text()
        await asyncio.sleep(0.1)
        held = tracemalloc.get_traced_memory()[0] - before
        assert held < LIMIT, f"{held / 2**20:.1f} MiB still held after three refused bodies"
        assert a.calls == []
