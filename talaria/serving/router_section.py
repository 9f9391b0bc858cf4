"""The serve config's ``[router]`` table (``talaria.serving.config`` reads and checks it; the
CLI turns it into the router's ``RouterConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RouterSection"]


@dataclass
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "talaria"
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    poll_interval_s: float = 1.0
    instance_key: str | None = None
    first_token_timeout_s: float = 300.0
    stall_timeout_s: float = 60.0
    max_inflight_calls: int = 1024
    max_session_id_chars: int = 256
    max_sessions: int = 100_000
    body_timeout_s: float = 30.0
    infer_sessions: bool = True
    session_headers: list[str] | None = None  # None: the router's default list
    max_tokens_overflow: str = "clamp"
    stream_commit_s: float = 10.0  # negative: at the first token only (router.api.stream_commit)
    stream_keepalive_s: float = 15.0
    cors_origins: list[str] = field(default_factory=list)  # browser origins allowed (router.cors)
