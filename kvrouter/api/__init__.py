"""The wire shapes (OpenAI, vLLM's extensions, Anthropic Messages), for every part that speaks them: the
gateway (lenient parsing: it forwards what it does not read), the simulated vLLM (strict parsing: it
refuses what vLLM refuses), the load generators and the reliability suite (reading ``usage``).

::

    errors.py     ApiError tree; the one error body {"error": {message, type, param, code}}, also as SSE
    fields.py     the JSON field checks every parser shares
    parsed.py     ParsedRequest: what the gateway reads of a request, whatever its route (kinds)
    requests.py   parse_body (gateway, every route) and parse_completion / parse_chat (simulator)
    responses.py  the Responses API: the gateway's reading, the simulator's, response objects and events
    messages.py   Anthropic's Messages API: the same, and its error shape
    usage.py      usage blocks (all three shapes): build one, read cached tokens, watch a stream for them
    bodies.py     vLLM's answers: completion and chat bodies, their SSE chunks, the usage chunk
    routes.py     the routed paths and their kinds, stored-response routes, admin paths (both front doors)
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
