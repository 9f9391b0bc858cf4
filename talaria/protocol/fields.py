"""Reading untrusted JSON field by field: each reader checks one value's type and range and
raises ValueError naming the field. What crosses the router/instance boundary is parsed with
these, never with ``cls(**data)``: a boolean is not an integer, a number is finite, an id is
printable ASCII of bounded length, and an unknown field is named, not ignored (where the
receiver is strict).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "MAX_ID_CHARS", "MAX_JSON_DEPTH", "DepthError", "boolean", "check_keys", "integer",
    "int_list", "is_int", "is_number", "json_depth", "number", "optional_text", "printable_id",
]

MAX_ID_CHARS = 1024  # call and session ids on the internal API (the router's bound is lower)
MAX_JSON_DEPTH = 64  # a tool's JSON schema nests about 10; Python recurses 1000 deep
_NAMED_LEVELS = 3  # how much of a too-deep value's path an error names


class DepthError(ValueError):
    """A JSON value nested too deep; ``path`` names where."""

    def __init__(self, message: str, path: str | None) -> None:
        super().__init__(message)
        self.path = path


def json_depth(value: Any, where: str | None = None, limit: int = MAX_JSON_DEPTH) -> None:
    """DepthError when ``value`` nests objects and arrays more than ``limit`` levels deep (its
    own level is 1), naming the field (``where``, then up to three levels of the path in it).
    Walked with a stack, not recursion: every recursive walk after it (a repr in an error
    message, a template, orjson's 255 levels) then stays within its limits."""
    if not isinstance(value, dict | list):
        return
    stack: list[tuple[Any, int, str | None]] = [(value, 1, where)]
    while stack:
        item, depth, path = stack.pop()
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in children:
            if not isinstance(child, dict | list):
                continue
            named = _child_path(path, key) if depth <= _NAMED_LEVELS else path
            if depth >= limit:
                raise DepthError(
                    f"{named or 'the request body'} is nested more than {limit} levels deep", named
                )
            stack.append((child, depth + 1, named))


def _child_path(path: str | None, key: Any) -> str:
    if isinstance(key, int):
        return f"{path or ''}[{key}]"
    return f"{path}.{key}" if path else str(key)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_keys(data: Mapping[str, Any], allowed: Collection[str], where: str) -> None:
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise ValueError(f"{where} has unknown field(s): {', '.join(unknown)}")


def printable_id(value: Any, name: str, max_chars: int = MAX_ID_CHARS) -> str:
    """A non-empty string of at most ``max_chars`` printable ASCII characters (space to
    tilde): safe in a header, a URL path segment and a log line."""
    rule = f"{name} must be a non-empty string of at most {max_chars} printable ASCII characters"
    if not isinstance(value, str) or not value:
        raise ValueError(rule)
    if len(value) > max_chars:
        raise ValueError(f"{rule}; it has {len(value)}")
    if not (value.isascii() and value.isprintable()):  # for ASCII: exactly space to tilde
        raise ValueError(f"{rule} (no control or non-ASCII characters)")
    return value


def integer(value: Any, name: str, lo: int | None = None) -> int:
    if not is_int(value) or (lo is not None and value < lo):
        raise ValueError(f"{name} must be an integer{f' >= {lo}' if lo is not None else ''}")
    return int(value)


def number(value: Any, name: str, lo: float | None = None) -> float:
    if not is_number(value) or (lo is not None and value < lo):
        raise ValueError(f"{name} must be a finite number{f' >= {lo:g}' if lo is not None else ''}")
    return float(value)


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean")
    return value


def int_list(value: Any, name: str, lo: int = 0) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) and t >= lo for t in value):
        raise ValueError(f"{name} must be a list of integers >= {lo}")
    return list(value)


def optional_text(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or null")
    return value
