"""The OpenAI-compatible wire shapes, for every part that speaks them: the gateway (lenient parsing: it
forwards what it does not read), the simulated vLLM (strict parsing: it refuses what vLLM refuses), the
load generators and the reliability suite (reading ``usage``).

::

    errors.py     ApiError tree; the one error body {"error": {message, type, param, code}}, also as SSE
    requests.py   parse_body (gateway) and parse_completion / parse_chat (simulator); vLLM's refusals
    usage.py      usage blocks: build one, read cached tokens from one, watch a response stream for it
    bodies.py     vLLM's answers: completion and chat bodies, their SSE chunks, the usage chunk
"""

from .errors import (
    ApiError,
    BadGateway,
    BadRequest,
    InternalError,
    NotFound,
    Overloaded,
    ServiceUnavailable,
    Unauthorized,
    error_body,
    sse_error,
)
from .requests import Kind, ParsedRequest, parse_body
from .usage import UsageReport, UsageWatcher, read_usage, usage

__all__ = [
    "ApiError",
    "BadGateway",
    "BadRequest",
    "InternalError",
    "Kind",
    "NotFound",
    "Overloaded",
    "ParsedRequest",
    "ServiceUnavailable",
    "Unauthorized",
    "UsageReport",
    "UsageWatcher",
    "error_body",
    "parse_body",
    "read_usage",
    "sse_error",
    "usage",
]
