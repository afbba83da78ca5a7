"""Reading JSON request bodies: the checks every parser of the API shares (gateway and simulator)."""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import BadRequest

_decode = msgspec.json.Decoder()


def decode_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (400 when empty, not JSON, or not an object)."""
    if not raw:
        raise BadRequest("the request body is empty")
    try:
        body = _decode.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def token_ids(v: object) -> bool:
    """A non-empty list of token ids (each fits vLLM's uint32 vocabulary index)."""
    return isinstance(v, list) and bool(v) and all(is_int(t) and 0 <= t < 2**32 for t in v)


def opt(body: dict[str, Any], key: str, kind: str) -> Any:
    """``body[key]`` if present and of ``kind``; None if absent or null; a 400 naming the field otherwise."""
    v = body.get(key)
    if v is None:
        return None
    ok = {
        "bool": isinstance(v, bool),
        "int": is_int(v),
        "number": is_number(v),
        "str": isinstance(v, str),
        "dict": isinstance(v, dict),
        "list": isinstance(v, list),
    }[kind]
    if not ok:
        article = "an" if kind[0] in "aeiou" else "a"
        raise BadRequest(f"'{key}' must be {article} {kind}", param=key)
    return v


def salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    return salt
