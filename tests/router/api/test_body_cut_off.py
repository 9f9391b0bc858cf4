"""A client that closes its connection before its request body has arrived is no internal
error: the router (and an instance, whose poller gave up on a late poll the same way) logged
an ``unhandled_error`` traceback and counted a 500 for it. Now it is an info line."""

from __future__ import annotations

import asyncio

from api_helpers import reply, serve
from router_fakes import FakeInstance
from structlog.testing import capture_logs

from router.tokenization import ModelTokenizer


async def test_a_client_gone_before_its_body_arrived_is_no_internal_error(
    tokenizer: ModelTokenizer,
) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        with capture_logs() as logs:
            reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                         b'{"model": "tiny", ')
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.2)
        assert [e for e in logs if e["log_level"] in ("error", "critical")] == []
        assert any(e["event"] == "request.client_gone" for e in logs), logs
        assert (await client.get("/live")).status == 200
