"""The routes both front doors serve (the aiohttp gateway and the endpoint picker): one table, so they
cannot drift apart.

::

    ROUTED        path ─▶ Kind   the body is read, tokenized and routed by its prompt (POST)
    INVOCATION_PATHS             SageMaker's /invocations: chat or completions, as the body reads
    STORED        /v1/responses/{id}[/cancel]   to the instance holding the stored response
    ADMIN_PATHS   the router's own operator routes and vLLM's, guarded by ``gateway.admin_token``

Anything else is the front door's own: the gateway passes it through by model and load, the picker
refuses a request with a body on a path outside ``ROUTED`` (it cannot tell how to read it).
"""

from __future__ import annotations

import re

from .requests import Kind

ROUTED: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/embeddings": "pooling",
    "/pooling": "pooling",
    "/classify": "pooling",
    "/score": "pooling",
    "/v1/score": "pooling",
    "/rerank": "pooling",
    "/v1/rerank": "pooling",
    "/v2/rerank": "pooling",
    "/v2/embed": "pooling",
}
"""vLLM's routes whose body is read and routed by its prompt, and how each is read."""

INVOCATION_PATHS: dict[Kind | None, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
"""Where an ``/invocations`` request goes, by the kind its body reads as (SageMaker's contract)."""

STORED = re.compile(r"^/v1/responses/([^/?]+)(?:/cancel)?$")
"""A stored response's routes (GET it, POST .../cancel); group 1 is its id."""

ADMIN_PATHS = frozenset(
    {
        # the router's own
        "/v1/route/explain",
        "/v1/cache/lookup",
        "/v1/fleet",
        # vLLM's operator routes, passed through to the instances: never a client's to call
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/sleep",
        "/wake_up",
        "/pause",
        "/resume",
        "/collective_rpc",
        "/scale_elastic_ep",
        "/start_profile",
        "/stop_profile",
    }
)
"""Routes that need ``gateway.admin_token`` when one is set."""


def route_path(path: str) -> str:
    """A request target's path as the tables spell it: without its query and trailing slash."""
    p = path.split("?", 1)[0]
    return p.rstrip("/") or "/"


def kind_of(path: str) -> Kind | None:
    """How a POST to ``path`` is read and routed; None when it is not in ``ROUTED``."""
    return ROUTED.get(route_path(path))


def stored_response_id(path: str) -> str | None:
    """The id a stored response's route names; None for any other path."""
    m = STORED.match(route_path(path))
    return m.group(1) if m else None


def is_admin(path: str) -> bool:
    return route_path(path) in ADMIN_PATHS
