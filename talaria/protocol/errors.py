"""HTTP errors as both servers answer them: ``{"error": {"message", "type", "param", "code"}}``.

The shape is OpenAI's; the router's public API and the instance's internal API both use it.
Handlers raise :class:`ApiError`; :func:`error_middleware` turns it (and aiohttp's own HTTP
errors, e.g. the 413 that ``client_max_size`` raises) into a JSON response, so a server never
answers an error with HTML and keeps serving afterwards.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
import structlog
from aiohttp import web

log = structlog.get_logger(__name__)

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",  # OpenAI's type for every 5xx (its SDKs branch on the status)
    502: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """An error that becomes one OpenAI-style JSON response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}
        self.extra = extra or {}  # top-level fields beside "error" (e.g. retry_after_s)
        self.close_connection = close_connection  # the connection cannot serve another request

    def body(self) -> dict[str, Any]:
        return {**error_body(self.message, self.error_type, self.param, self.code), **self.extra}

    def response(self) -> web.Response:
        return self.closing(web.Response(
            status=self.status,
            body=orjson.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        ))

    def closing(self, response: web.Response) -> web.Response:
        """``response`` (this error's, in any API's shape), with ``Connection: close`` when
        the error leaves the connection unusable."""
        if self.close_connection:
            response.force_close()
        return response


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def unauthorized() -> ApiError:
    return ApiError(401, "invalid API key", code="invalid_api_key")


def unknown_model(model: str, known: list[str]) -> ApiError:
    return ApiError(
        404,
        f"the model {model!r} does not exist; known models: {', '.join(sorted(known))}",
        param="model",
        code="model_not_found",
    )


MAX_RETRY_AFTER_S = 3600.0


def overloaded(message: str, retry_after_s: float) -> ApiError:
    """429 with ``Retry-After`` (whole seconds) and ``retry_after_s`` in the body, clamped
    to [1, ``MAX_RETRY_AFTER_S``] (not a number: 1)."""
    seconds = float(retry_after_s)
    seconds = 1.0 if math.isnan(seconds) else min(MAX_RETRY_AFTER_S, max(1.0, seconds))
    return ApiError(
        429,
        message,
        code="rate_limit_exceeded",
        headers={"Retry-After": str(math.ceil(seconds))},
        extra={"retry_after_s": seconds},
    )


def no_healthy_instance(message: str) -> ApiError:
    return ApiError(503, message, code="no_healthy_instance")


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge as exc:
        return ApiError(413, exc.text or "request body too large", code="request_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason or "error", headers=_allow(exc)).response()
    except Exception:
        log.exception("unhandled_error", path=request.path)
        return ApiError(500, "internal error").response()


def _allow(exc: web.HTTPException) -> dict[str, str]:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}
