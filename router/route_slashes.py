"""Every API route also answers at its path with one trailing slash, and with its slashes
doubled anywhere.

A client that builds its URLs by joining strings (``base_url + "/chat/completions/"``, a
configured endpoint ending in ``/``) asks for ``/v1/chat/completions/``, or, with a base URL
ending in ``/``, for ``//v1/messages`` or ``/v1//chat/completions``; servers built on
Starlette (vLLM, SGLang, LiteLLM) and Ollama's redirect the first to the path without the
slash, and the router answered 404 to all of them. They are the same route here, served in
place rather than redirected (a client may not resend a POST's body to a redirect), so the
answer, its errors' shape and the key check are the route's own: whatever reads a request's
path to decide (the key check, Anthropic's error shape) reads ``merged_path``.
"""

from __future__ import annotations

import re

from aiohttp import web

__all__ = ["add_merged_slash_routes", "add_trailing_slash_routes", "merged_path"]

_SLASHES = re.compile("/+")


def add_trailing_slash_routes(router: web.UrlDispatcher) -> None:
    """Each route added so far, again at its path plus ``/`` (``/`` itself has none; a GET
    takes HEAD there too, as ``add_get`` gives it), but for a route whose own pattern takes
    the slash already (``/v1/models/{model_id:.+}``): a copy would never be matched."""
    for route in list(router.routes()):
        path = route.resource.canonical if route.resource is not None else ""
        if not path or path.endswith("/") or route.method == "HEAD" or _takes_slash(route.resource):
            continue
        if route.method == "GET":
            router.add_get(path + "/", route.handler)
        else:
            router.add_route(route.method, path + "/", route.handler)


def _takes_slash(resource: web.AbstractResource | None) -> bool:
    """A dynamic route whose pattern matches one of its own paths with ``/`` appended."""
    info = resource.get_info() if resource is not None else {}
    pattern, formatter = info.get("pattern"), info.get("formatter")
    if pattern is None or formatter is None:
        return False
    sample = re.sub(r"{[^}]+}", "x", formatter)
    return pattern.fullmatch(sample + "/") is not None


def add_merged_slash_routes(router: web.UrlDispatcher) -> None:
    """Each fixed-path route added so far (but ``/`` and the trailing-slash copies), again
    with every one of its slashes taking one or more, and any trailing ones:
    ``//v1//messages/`` is ``/v1/messages``. Added after the routes themselves, so an exact
    path matches its own route first. A route with a variable in its path
    (``/v1/models/{model_id}``) gets none."""
    for route in list(router.routes()):
        path = route.resource.canonical if isinstance(route.resource, web.PlainResource) else ""
        if path in ("", "/") or path.endswith("/") or route.method == "HEAD":
            continue
        parts = path.strip("/").split("/")
        pattern = "/{_slash0:/*}" + "".join(
            part if i == 0 else f"{{_slash{i}:/+}}{part}" for i, part in enumerate(parts))
        pattern += f"{{_slash{len(parts)}:/*}}"
        if route.method == "GET":
            router.add_get(pattern, route.handler)
        else:
            router.add_route(route.method, pattern, route.handler)


def merged_path(path: str) -> str:
    """``path`` with each run of slashes one slash: what it names."""
    return _SLASHES.sub("/", path)
