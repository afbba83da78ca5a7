"""The routes the lean core serves itself: POST to the routed OpenAI, Anthropic and SageMaker paths.

Every other request (another method, another path, the admin and pass-through routes) is aiohttp's
(``gateway.handlers``).  Each route here is the aiohttp route of the same path, routed the same way
(``forwarding.route_and_forward`` with the same kind and upstream path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ...api.requests import Kind, ParsedRequest
from ...api.routes import INVOCATION_PATHS, ROUTED


class Route(NamedTuple):
    kind: Kind | None
    """How the body is read (None: chat or completions, as the body says)."""
    label: str
    """The route's label in ``kvrouter_requests_total`` (aiohttp's canonical path for it)."""
    upstream: Callable[[str, ParsedRequest], str]
    """The upstream path, from the client's path and query and the parsed request."""


def _same(path_qs: str, req: ParsedRequest) -> str:
    return path_qs


def _invocation(path_qs: str, req: ParsedRequest) -> str:
    return INVOCATION_PATHS[req.kind]


def lean_routes() -> dict[bytes, Route]:
    """Path (as sent, without the query) -> route."""
    routes = {path: Route(kind, path, _same) for path, kind in ROUTED.items()}
    routes["/invocations"] = Route(None, "/invocations", _invocation)
    return {p.encode(): r for p, r in routes.items()}
