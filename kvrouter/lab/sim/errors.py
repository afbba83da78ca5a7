"""The simulator's error tree.  Each error carries a short ``reason`` usable as a metric label.

SimError
├── SimConfigError       an invalid engine, timing or publisher config (raised by ``validate()``)
│   └── UnknownProfile   a timing profile name that is not in ``timing.PROFILES``
├── RequestRejected      a request the engine refuses at ``add_request`` (the shell answers 400)
│   ├── DuplicateRequest the request id is already in the engine
│   └── RequestTooLong   prompt + max_tokens exceeds max_model_len
└── PublisherError       the event publisher cannot do what was asked (e.g. it is not started)
"""

from __future__ import annotations


class SimError(Exception):
    reason = "error"


class SimConfigError(SimError):
    reason = "config"


class UnknownProfile(SimConfigError):
    reason = "unknown_profile"


class RequestRejected(SimError):
    reason = "rejected"


class DuplicateRequest(RequestRejected):
    reason = "duplicate_request"


class RequestTooLong(RequestRejected):
    reason = "too_long"


class PublisherError(SimError):
    reason = "publisher"
