"""Browser origins as CORS names them, for the router's opt-in CORS (``router.cors``): the
check a configured list of allowed origins must pass, shared by ``RouterConfig`` and the
serve config's ``[router].cors_origins``."""

from __future__ import annotations

import re

__all__ = ["ANY_ORIGIN", "origins_problem"]

ANY_ORIGIN = "*"
# scheme://host[:port], as a browser's Origin header writes it: no path, no trailing slash
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")


def origins_problem(origins: object) -> str | None:
    """Why ``origins`` cannot be a list of allowed origins (None: it can): each must be
    ``"*"`` (any origin) or an origin as browsers send it; one with a path or a trailing
    slash would match no request."""
    if not isinstance(origins, list | tuple) or not all(isinstance(o, str) for o in origins):
        return f"must be a list of origins such as 'http://localhost:5173', got {origins!r}"
    bad = next((o for o in origins if o != ANY_ORIGIN and not _ORIGIN.fullmatch(o)), None)
    if bad is not None:
        return (f"holds {bad!r}, which is no origin a browser sends: scheme://host[:port] without "
                f"a path (e.g. 'http://localhost:5173'), or '*' for any")
    return None
