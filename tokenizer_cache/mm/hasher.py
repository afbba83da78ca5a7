"""A multimodal item's identifier, as vLLM 0.32-0.33 computes it (``multimodal/hasher.py``).

``hash_kwargs(model_id=..., image=item[, mm_processor_kwargs=...])``: the keyword arguments in name order,
each as its name then its value; the byte stream is framed so that it decodes one way only::

    chunk     = length (8 bytes, little endian) + bytes
    value     = 0x00                                   None
              | 0x01 + count + value...                a list or tuple
              | 0x02 + count + (chunk(key) + value)... a dict, in its order
              | 0x03 + leaf                            anything else
    leaf      = chunk(bytes) | chunk(utf-8 of a str) | chunk(numpy scalar bytes of an int, float, bool)
              | chunk("image") + value                 an image: its original bytes, or
                                                       {"io_config": ..., "data": bytes} when converted
    item      = chunk(name) + value                    for each keyword argument

The digest is BLAKE3 (vLLM's default), SHA-256 or SHA-512 (``--mm-hasher-algorithm``), in hex.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping
from typing import Any, Literal

import blake3
import numpy as np

__all__ = ["HashAlgorithm", "ImageBytes", "UnhashableValue", "hash_kwargs"]

HashAlgorithm = Literal["blake3", "sha256", "sha512"]

_NONE, _SEQ, _MAP, _LEAF = b"\x00", b"\x01", b"\x02", b"\x03"


class UnhashableValue(TypeError):
    """A value of a type this module does not frame (vLLM would pickle it: not reproduced)."""


class ImageBytes:
    """An image item: its original (encoded) bytes, and the conversion vLLM applied when it made a new
    image (``io_config``: ``{"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}``), or None."""

    __slots__ = ("data", "io_config")

    def __init__(self, data: bytes | memoryview, io_config: Mapping[str, Any] | None = None) -> None:
        self.data = data
        self.io_config = io_config


def _length(n: int) -> bytes:
    return struct.pack("<Q", n)


def _chunk(update: Callable[[Any], object], b: bytes | memoryview) -> None:
    update(_length(b.nbytes if isinstance(b, memoryview) else len(b)))
    update(b)


def _leaf(update: Callable[[Any], object], obj: Any) -> None:
    if isinstance(obj, (bytes, memoryview)):
        _chunk(update, obj)
    elif isinstance(obj, str):
        _chunk(update, obj.encode("utf-8"))
    elif isinstance(obj, (int, float)):  # bool included: numpy writes one byte for it
        _chunk(update, np.array(obj).tobytes())
    elif isinstance(obj, ImageBytes):
        if obj.io_config:
            _item(update, "image", {"io_config": dict(obj.io_config), "data": obj.data})
        else:
            _item(update, "image", obj.data)
    else:
        raise UnhashableValue(f"cannot frame a {type(obj).__name__} as vLLM does")


def _value(update: Callable[[Any], object], obj: Any) -> None:
    if obj is None:
        update(_NONE)
    elif isinstance(obj, (list, tuple)):
        update(_SEQ)
        update(_length(len(obj)))
        for x in obj:
            _value(update, x)
    elif isinstance(obj, dict):
        update(_MAP)
        update(_length(len(obj)))
        for k, v in obj.items():
            _chunk(update, str(k).encode("utf-8"))
            _value(update, v)
    else:
        update(_LEAF)
        _leaf(update, obj)


def _item(update: Callable[[Any], object], key: str, obj: Any) -> None:
    _chunk(update, key.encode("utf-8"))
    _value(update, obj)


def _hasher(algorithm: HashAlgorithm) -> Any:
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "sha512":
        return hashlib.sha512()
    raise ValueError(f"unknown multimodal hash algorithm {algorithm!r}")


def hash_kwargs(algorithm: HashAlgorithm, /, **kwargs: Any) -> str:
    """vLLM's ``MultiModalHasher.hash_kwargs``: the hex digest of the framed keyword arguments."""
    h = _hasher(algorithm)
    for k, v in sorted(kwargs.items(), key=lambda kv: kv[0]):
        _item(h.update, k, v)
    return str(h.hexdigest())
