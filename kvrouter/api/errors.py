"""Errors answered over HTTP, and the one body they are answered with.

Every error the gateway or the simulated vLLM answers has vLLM's shape
``{"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}``::

    ApiError                     status, type, reason (a metric label)
    ├── BadRequest          400  the request is malformed or asks for something refused
    ├── Unauthorized        401  missing or unknown API key, admin token required
    ├── NotFound            404  unknown model (or route)
    ├── PayloadTooLarge     413  the body is longer than the gateway accepts
    ├── Overloaded          429  shed: come back later (Retry-After)
    ├── InternalError       500  a bug, never the client's fault
    ├── BadGateway          502  the chosen instance failed (before or during the answer)
    └── ServiceUnavailable  503  no instance can serve this (or the simulated engine is down)
"""

from __future__ import annotations

import msgspec

_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """An error answer: ``status`` and ``err_type`` as vLLM sets them, ``reason`` as a metric label."""

    status = 500
    err_type = "InternalServerError"
    reason = "internal"

    def __init__(self, message: str, param: str | None = None, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if reason is not None:
            self.reason = reason
        self.headers: dict[str, str] = {}
        """Headers the answer carries besides its content type (the reason a request was refused)."""

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.err_type, self.param)


class BadRequest(ApiError):
    status = 400
    err_type = "BadRequestError"
    reason = "bad_request"


class Unauthorized(ApiError):
    status = 401
    err_type = "UnauthorizedError"
    reason = "unauthorized"


class NotFound(ApiError):
    status = 404
    err_type = "NotFoundError"
    reason = "not_found"


class PayloadTooLarge(ApiError):
    status = 413
    err_type = "RequestEntityTooLargeError"
    reason = "payload_too_large"


class Overloaded(ApiError):
    status = 429
    err_type = "TooManyRequestsError"
    reason = "overloaded"
    retry_after_s: int | None = None
    """When the client may come back, if this refusal knows (a rate limit); else the configured default."""


class InternalError(ApiError):
    status = 500
    err_type = "InternalServerError"
    reason = "internal"


class BadGateway(ApiError):
    status = 502
    err_type = "BadGatewayError"
    reason = "upstream_failed"


class ServiceUnavailable(ApiError):
    status = 503
    err_type = "ServiceUnavailableError"
    reason = "unavailable"


_TYPES = {c.status: c.err_type for c in (BadRequest, Unauthorized, NotFound, Overloaded, BadGateway)} | {
    500: InternalError.err_type,
    503: ServiceUnavailable.err_type,
}


def error_body(status: int, message: str, err_type: str | None = None, param: str | None = None) -> bytes:
    """The error body for ``status`` (``err_type`` defaults to the type of that status)."""
    kind = err_type or _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return _encode({"error": {"message": message, "type": kind, "param": param, "code": status}})


def sse_error(err: ApiError) -> bytes:
    """An error inside a stream that already began: one SSE event with the error body, then ``[DONE]``."""
    return b"data: " + err.body() + b"\n\ndata: [DONE]\n\n"
