"""The two calls of the API server's list-and-watch protocol, over aiohttp (the shell of discovery).

::

    GET <collection>?labelSelector=..&limit=N[&continue=T]               ──▶ one page (JSON body)
    GET <collection>?labelSelector=..&watch=1&resourceVersion=RV
                    &allowWatchBookmarks=true&timeoutSeconds=S             ──▶ JSON lines, one event each

A non-2xx answer raises ``ApiStatusError`` (``ResourceExpired`` for 410).  Lines are split here rather
than with ``readline`` because a slice of 1000 endpoints is larger than aiohttp's line limit.  Responses
are asked for uncompressed: the session may have ``auto_decompress=False`` (the gateway's has).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping

import aiohttp
import msgspec

from .config import KubeConnection
from .endpointslices import Status
from .errors import ApiStatusError, ResourceExpired

_MAX_LINE = 64 << 20
"""A longer watch line is a broken stream, not an object."""

_status = msgspec.json.Decoder(Status)


def _raise_for(code: int, body: bytes) -> None:
    try:
        st = _status.decode(body)
    except msgspec.DecodeError:
        st = Status(code=code)
    if code == 410:
        raise ResourceExpired(st.message or "resourceVersion expired")
    raise ApiStatusError(code, st.message)


class KubeClient:
    def __init__(self, conn: KubeConnection, session: aiohttp.ClientSession) -> None:
        self.conn = conn
        self.session = session
        self._ssl = conn.ssl_context()

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json", "Accept-Encoding": "identity"}
        token = self.conn.bearer()
        if token:
            h["Authorization"] = f"Bearer {token}"
        return h

    async def get(self, path: str, params: Mapping[str, str], timeout_s: float = 30.0) -> bytes:
        """One LIST page (or any GET); the body of a 2xx answer."""
        async with self.session.get(
            self.conn.base_url + path,
            params=params,
            headers=self._headers(),
            ssl=self._ssl,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            body = await r.read()
            if r.status // 100 != 2:
                _raise_for(r.status, body)
            return body

    async def watch(
        self, path: str, params: Mapping[str, str], read_timeout_s: float
    ) -> AsyncGenerator[bytes, None]:
        """The lines of one WATCH, until the server ends it.  A connection lost mid-stream raises
        ``aiohttp.ClientPayloadError`` or ``ClientConnectionError``; a silent one ``TimeoutError``."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=read_timeout_s)
        async with self.session.get(
            self.conn.base_url + path, params=params, headers=self._headers(), ssl=self._ssl, timeout=timeout
        ) as r:
            if r.status // 100 != 2:
                _raise_for(r.status, await r.read())
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield line
                if len(buf) > _MAX_LINE:
                    raise aiohttp.ClientPayloadError("watch line too long")
            if buf.strip():
                yield buf
