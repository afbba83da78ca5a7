"""The gateway's error tree: what goes wrong between the gateway and an upstream or its client.

::

    GatewayError
    ├── UpstreamFailed   an attempt failed before its first byte (``reason`` a metric label; ``connection``:
    │                    the instance could not be reached, so it leaves rotation at once; ``limit_s``: the
    │                    timeout that ran out, when it was one)
    ├── AdapterMissing   the instance answered 404 for a LoRA adapter it no longer has (unloaded after
    │                    the router last looked): not its failure; the next holder is tried
    └── ClientGone       the client closed its connection; the upstream request is aborted

What a client is answered with is an ``api.errors.ApiError``; these never reach a client as such.
"""

from __future__ import annotations


class GatewayError(Exception):
    reason = "gateway"


class UpstreamFailed(GatewayError):
    def __init__(self, reason: str, *, connection: bool, limit_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.connection = connection
        self.limit_s = limit_s
        """The timeout that ran out (None: not a timeout: refused, reset, 5xx)."""


class AdapterMissing(GatewayError):
    reason = "adapter_missing"

    def __init__(self, adapter: str, body: bytes) -> None:
        super().__init__(adapter)
        self.adapter = adapter
        self.body = body


class ClientGone(GatewayError):
    """The client closed its connection; the upstream request is aborted."""

    reason = "client_gone"
