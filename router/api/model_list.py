"""The catalog's routes: ``GET /v1/models`` and ``GET /v1/models/{id}``, each model in the
OpenAI and the Anthropic shapes at once (each SDK reads its own fields and ignores the other's;
both SDKs' ``models.retrieve`` ask for one model by its id). An id not in the catalog is the
404 a call naming it gets."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from router.tokenization import ModelTokenizer
from talaria.protocol.errors import unknown_model

__all__ = ["model_routes"]


def model_routes(tokenizers: Mapping[str, ModelTokenizer]) -> list[web.RouteDef]:
    async def listing(request: web.Request) -> web.Response:
        created = int(time.time())
        data = [_entry(name, tok, created) for name, tok in sorted(tokenizers.items())]
        return _json({"object": "list", "data": data, "has_more": False,
                      "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})

    async def one(request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        tok = tokenizers.get(name)
        if tok is None:
            raise unknown_model(name, list(tokenizers))
        return _json(_entry(name, tok, int(time.time())))

    return [web.get("/v1/models", listing), web.get("/v1/models/{model_id:.+}", one)]


def _entry(name: str, tok: ModelTokenizer, created: int) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return {"id": name, "object": "model", "created": created, "owned_by": "talaria",
            "max_model_len": tok.context_len, "type": "model", "display_name": name, "created_at": stamp}


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")
