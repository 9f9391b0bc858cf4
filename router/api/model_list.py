"""The catalog's routes: ``GET /v1/models`` and ``GET /v1/models/{id}``, each model in the
OpenAI and the Anthropic shapes at once (each SDK reads its own fields and ignores the other's;
both SDKs' ``models.retrieve`` ask for one model by its id). An id not in the catalog is the
404 a call naming it gets.

The list is by name. Asked in Anthropic's shape (``anthropic-version``, which the Anthropic SDK
sends), it is paged as Anthropic's List Models is: at most ``limit`` models (1 to 1000,
default 20) after ``after_id`` or just before ``before_id``, ``first_id`` / ``last_id`` the
page's ends and ``has_more`` whether more lie beyond it in the direction asked; a bad
``limit``, an id not in the list or both ids given is a 400 naming the field. OpenAI's list
has no pages: every model, ``has_more`` false, whatever the query holds."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from router.api.anthropic_api import anthropic_shaped
from router.tokenization import ModelTokenizer
from talaria.protocol.errors import bad_request, unknown_model

__all__ = ["model_routes"]

DEFAULT_LIMIT = 20  # Anthropic's
MAX_LIMIT = 1000


def model_routes(tokenizers: Mapping[str, ModelTokenizer]) -> list[web.RouteDef]:
    async def listing(request: web.Request) -> web.Response:
        created = int(time.time())
        names, has_more = sorted(tokenizers), False
        if anthropic_shaped(request):
            names, has_more = _page(names, request.query)
        data = [_entry(name, tokenizers[name], created) for name in names]
        return _json({"object": "list", "data": data, "has_more": has_more,
                      "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})

    async def one(request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name not in tokenizers and name.endswith("/"):
            name = name[:-1]  # the path's trailing slash (router.route_slashes)
        tok = tokenizers.get(name)
        if tok is None:
            raise unknown_model(name, list(tokenizers))
        return _json(_entry(name, tok, int(time.time())))

    return [web.get("/v1/models", listing), web.get("/v1/models/{model_id:[^/].*}", one)]


def _page(names: list[str], query: Mapping[str, str]) -> tuple[list[str], bool]:
    """The page of ``names`` the query asks for, and whether more lie beyond it (after it;
    before it when paging back from ``before_id``)."""
    raw = query.get("limit", str(DEFAULT_LIMIT))
    limit = int(raw) if raw.isascii() and raw.isdecimal() else 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw!r}", "limit")
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise bad_request("after_id and before_id cannot both be given (a page goes one way)", "before_id")
    if before is not None:
        end = _index(names, before, "before_id")
        start = max(0, end - limit)
        return names[start:end], start > 0
    start = 0 if after is None else _index(names, after, "after_id") + 1
    return names[start:start + limit], start + limit < len(names)


def _index(names: list[str], model: str, field: str) -> int:
    try:
        return names.index(model)
    except ValueError:
        raise bad_request(f"{field} {model!r} is not a model in the list", field) from None


def _entry(name: str, tok: ModelTokenizer, created: int) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return {"id": name, "object": "model", "created": created, "owned_by": "talaria",
            "max_model_len": tok.context_len, "type": "model", "display_name": name, "created_at": stamp}


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")
