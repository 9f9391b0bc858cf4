"""Opt-in CORS, for browser-based clients: ``RouterConfig.cors`` lists the origins allowed
(``"*"``: any); none by default, when the router answers as it always did (no CORS header,
an ``OPTIONS`` its route's 405).

With origins allowed, a request whose ``Origin`` is one of them gets
``Access-Control-Allow-Origin`` (and every response header exposed) on whatever answers it:
a streamed answer's headers, an error, a 401. Its preflight (``OPTIONS`` with
``Access-Control-Request-Method``) on a route the API has is a 204, answered before the API
key is checked (a browser sends none with it), naming the route's methods and allowing the
headers asked for and those the APIs read (``Authorization``, ``x-api-key``,
``anthropic-version``, the session headers). A preflight from another origin, or on no
route, is answered as without CORS. A list of origins (not ``"*"``) adds ``Vary: Origin``
to every response, so a cache keeps each origin's answer apart."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.sessions.identity import SessionHeaders
from talaria.protocol.origins import ANY_ORIGIN, origins_problem

__all__ = ["CorsConfig", "install_cors"]

PREFLIGHT_MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer
# Headers a browser call of the APIs sends (the session headers join them)
API_HEADERS = ("authorization", "content-type", "x-api-key", "anthropic-version", "anthropic-beta")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110's token


@dataclass(frozen=True)
class CorsConfig:
    """The browser origins allowed to call the router (none: CORS off)."""

    origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problem = origins_problem(self.origins)
        if problem is not None:
            raise ValueError(f"cors origins {problem}")

    def allowed(self, origin: str | None) -> str | None:
        """``Access-Control-Allow-Origin`` for a request from ``origin`` (None: not allowed).
        Browsers write an origin's scheme and host in lowercase; a configured one may not."""
        if not origin or not self.origins:
            return None
        if ANY_ORIGIN in self.origins:
            return ANY_ORIGIN
        return origin if origin.lower() in (o.lower() for o in self.origins) else None


def install_cors(app: web.Application, cors: CorsConfig, session_headers: SessionHeaders) -> None:
    """CORS on ``app`` as ``cors`` allows (nothing when it allows no origin). Call it before
    the app starts: the preflight's middleware goes first, ahead of the key's."""
    if not cors.origins:
        return
    always = (*API_HEADERS, *session_headers.session, *session_headers.parent, *session_headers.final)

    @web.middleware
    async def preflight(request: web.Request, handler: Any) -> web.StreamResponse:
        route = request.match_info.http_exception  # a 405: the route is there, OPTIONS is not
        if (request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers
                or not isinstance(route, web.HTTPMethodNotAllowed)
                or cors.allowed(request.headers.get("Origin")) is None):
            return await handler(request)  # answered as without CORS
        asked = (h.strip().lower() for h in request.headers.get("Access-Control-Request-Headers", "").split(","))
        headers = dict.fromkeys((*(h for h in asked if _HEADER_NAME.fullmatch(h)), *always))
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": ", ".join(sorted(route.allowed_methods)),
            "Access-Control-Allow-Headers": ", ".join(headers),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        })

    async def allow_origin(request: web.Request, response: web.StreamResponse) -> None:
        """Every answer, as its headers go out (a stream's too): the origin's allowance."""
        if ANY_ORIGIN not in cors.origins:
            vary = response.headers.get("Vary")
            response.headers["Vary"] = f"{vary}, Origin" if vary else "Origin"
        allowed = cors.allowed(request.headers.get("Origin"))
        if allowed is not None:
            response.headers["Access-Control-Allow-Origin"] = allowed
            response.headers["Access-Control-Expose-Headers"] = "*"

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(allow_origin)
