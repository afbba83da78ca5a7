"""The OpenAI-compatible proxy (aiohttp): the front door that carries the bytes itself.

::

    app.py               Gateway: every component of one process, wired, started and stopped together
    handlers.py          the HTTP routes and the error middleware; build_gateway
    proxy.py             one routed request upstream and back, streaming, retries before the first byte
    upstream.py          the fleet as the proxy sees it: health, ejection, engine load, served models
    membership_*.py,     instances joining and leaving at run time (kvrouter.membership), applied to
    fleet_membership.py  this gateway's pool, subscriber and index
    metrics.py           the proxy's own metrics (the request path's are pipeline.metrics)
    errors.py            upstream failures and vanished clients

Routing itself is not here: every request goes through ``kvrouter.pipeline.RequestPipeline``.
"""

from .app import Gateway
from .handlers import build_gateway

__all__ = ["Gateway", "build_gateway"]
