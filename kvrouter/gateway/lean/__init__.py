"""The lean core: the routed routes (completions, chat, responses, messages, invocations, pooling) on a
hand-built HTTP/1.1 server (httptools on the event loop's transports); aiohttp serves the rest on the same
port (``gateway.front: lean``).

::

    core.py       LeanCore (one request's handling, connections), LeanSite (an aiohttp site), run
    protocol.py   LeanProtocol: one connection, parsed, requests in order, hand-over to aiohttp
    exchange.py   Exchange: one request, the ``Downstream`` its answer goes through; LeanHeaders
    routes.py     the lean routes and the upstream path of each
"""

from .core import LeanCore, LeanSite, run

__all__ = ["LeanCore", "LeanSite", "run"]
