"""Membership's error tree.  Each error carries a short ``reason``, used as a metric label.

MembershipError
├── FleetReloadError       a changed fleet file that cannot be used (the old membership stays)
│                          reason: ``unreadable`` | ``invalid``
├── EventSourcesError      an instance's GET /kv_event_sources answer cannot be used (it stays routed by
│                          load until it can); reason ``unreachable`` | ``invalid`` | ``disabled`` | ``ranks``
└── DiscoveryError         the Kubernetes API server could not be read (the last known membership stays)
    ├── ResourceExpired    410 Gone, as an HTTP status or as a watch ERROR event: relist
    ├── ApiStatusError     any other non-2xx answer or watch ERROR event; reason ``http_<code>``
    ├── ApiUnreachable     no answer: refused, reset, timed out; reason the client's error class
    └── BadWatchData       a line or object that is not what the API promises; reason ``decode``

Configuration errors are ``indexer.errors.ConfigError``, like the rest of the fleet file.
"""

from __future__ import annotations


class MembershipError(Exception):
    reason = "error"


class FleetReloadError(MembershipError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class EventSourcesError(MembershipError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class DiscoveryError(MembershipError):
    reason = "discovery"
    event = False
    """Sent as a watch ERROR event (rather than as the status of an HTTP answer)."""


class ResourceExpired(DiscoveryError):
    """The resourceVersion we hold is older than the API server keeps history for."""

    reason = "gone"


class ApiStatusError(DiscoveryError):
    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(f"HTTP {code}: {message}" if message else f"HTTP {code}")
        self.code = code
        self.reason = f"http_{code}"


class ApiUnreachable(DiscoveryError):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class BadWatchData(DiscoveryError):
    reason = "decode"
