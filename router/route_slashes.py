"""Every API route also answers at its path with one trailing slash.

A client that builds its URLs by joining strings (``base_url + "/chat/completions/"``, a
configured endpoint ending in ``/``) asks for ``/v1/chat/completions/``; servers built on
Starlette (vLLM, SGLang, LiteLLM) and Ollama's redirect it to the path without the slash, and
the router answered 404. The path with the slash is the same route here, served in place
rather than redirected (a client may not resend a POST's body to a redirect), so the answer,
its errors' shape and the key check are the route's own.
"""

from __future__ import annotations

import re

from aiohttp import web

__all__ = ["add_trailing_slash_routes"]


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
