"""Images and documents sent to a text-only model: a line of text in their place.

Agents resend their whole history every turn (Claude Code, Codex), so one image a tool once
returned (a screenshot or a diagram Claude Code's Read tool shows) would make every later
call a 400 and end the conversation for good. So every API puts a placeholder line in each
one's place instead of refusing it, naming what was left out:
``[image omitted: image/png, 48.2 KB; this model reads text only]`` (its media type and
decoded size when the request carries the data; ``from a URL`` or ``a stored file`` when it
only points to it), on a line of its own; the answer's ``X-Talaria-Media-Omitted`` header
says how many were replaced. The APIs' own forms are read here:
- Anthropic Messages: ``image`` and ``document`` blocks (sources ``base64``, ``url``,
  ``file``), in a user turn or in a ``tool_result``; a ``text`` document is plain text and
  goes in as its text, a ``content`` document as its blocks;
- Responses: ``input_image`` (``image_url``, a data URL or not; ``file_id``) and
  ``input_file`` (``file_data``, ``file_url``, ``file_id``, ``filename``) parts;
- chat completions: ``image_url`` and ``file`` parts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from talaria.protocol.errors import bad_request

__all__ = ["MEDIA_HEADER", "Omissions", "OwnLines", "join_text"]

MEDIA_HEADER = "X-Talaria-Media-Omitted"


class OwnLines(str):
    """Text that stands on lines of its own among a message's parts (:func:`join_text`): an
    image's or document's placeholder, a plain-text document's text."""


def join_text(parts: Iterable[str]) -> str:
    """Text parts joined as they are, each :class:`OwnLines` on lines of its own."""
    out, after = "", False  # after: the last part stands alone, so text after it starts a line
    for part in parts:
        if isinstance(part, OwnLines):
            out += ("\n" if out and not out.endswith("\n") else "") + part
            after = True
        else:
            out += ("\n" if after and part and not part.startswith("\n") else "") + part
            after = after and not part
    return out


@dataclass
class Omissions:
    """The placeholders written for one request, counted for its answer's header."""

    count: int = 0

    def headers(self) -> dict[str, str]:
        return {MEDIA_HEADER: str(self.count)} if self.count else {}

    def placeholder(self, kind: str, media_type: str | None = None, size: int | None = None,
                    origin: str | None = None) -> OwnLines:
        self.count += 1
        what = ", ".join(x for x in (media_type, _size(size), origin) if x)
        return OwnLines(f"[{kind} omitted{': ' + what if what else ''}; this model reads text only]")

    def anthropic_source(self, kind: str, block: dict[str, Any], where: str) -> OwnLines:
        """An Anthropic ``image`` or ``document`` block's placeholder (its ``source``)."""
        source = block.get("source")
        stype = source.get("type") if isinstance(source, dict) else None
        if not isinstance(stype, str):
            raise bad_request(f"{where}.source must be an object with a string type", f"{where}.source")
        media_type = source.get("media_type") if isinstance(source.get("media_type"), str) else None
        if stype == "base64":
            return self.placeholder(kind, media_type, _base64_size(source.get("data"), f"{where}.source.data"))
        if stype == "url":
            return self.placeholder(kind, media_type, origin="from a URL")
        if stype == "file":
            return self.placeholder(kind, media_type, origin="a stored file")
        raise bad_request(f"{where}.source: a {kind} source of type {stype!r} is not supported "
                          "(base64, url and file are)", f"{where}.source")

    def openai_image(self, url: Any, file_id: Any = None) -> OwnLines:
        """An image given as a URL (a ``data:`` URL carries its type and bytes) or a file id."""
        if isinstance(url, str) and url.startswith("data:"):
            return self.placeholder("image", *_data_url(url))
        return self.placeholder("image", origin="a stored file" if file_id else "from a URL")

    def openai_file(self, data: Any, name: Any = None, file_id: Any = None, url: Any = None) -> OwnLines:
        """A file given inline (``data``: a ``data:`` URL or bare base64), by URL or by id."""
        named = f"named {name!r}" if isinstance(name, str) and name else None
        if isinstance(data, str) and data:
            media_type, size = _data_url(data) if data.startswith("data:") else (None, _base64_size(data, "file"))
            return self.placeholder("file", media_type, size, named)
        origin = "from a URL" if url else "a stored file" if file_id else None
        return self.placeholder("file", origin=", ".join(x for x in (named, origin) if x) or None)


def _data_url(url: str) -> tuple[str | None, int | None]:
    """(media type, decoded size) of ``data:<type>[;base64],<data>``."""
    head, _, data = url[5:].partition(",")
    media_type = head.split(";")[0] or None
    size = _base64_size(data, "data URL") if head.endswith(";base64") else len(data)
    return media_type, size


def _base64_size(data: Any, where: str) -> int:
    if not isinstance(data, str):
        raise bad_request(f"{where} must be a base64 string", where)
    data = data.strip()
    return max(0, len(data) * 3 // 4 - (len(data) - len(data.rstrip("="))))


def _size(size: int | None) -> str | None:
    if size is None:
        return None
    for unit, scale in (("MB", 10**6), ("KB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
