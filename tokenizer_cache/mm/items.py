"""A request's media items: what each one is, and how the router learns its identifier and its size.

Each media part becomes a ``MediaRef`` (modality, URL, uuid) in prompt order while the messages are
converted (``tokenizer_cache.messages``).  ``MediaResolver.resolve`` then gives each image what its block
keys and placeholder count need: a uuid alone names it (its size from an earlier sighting, when the
count needs one; path "uuid"); a ``data:`` URL is decoded as vLLM checks it, its header gives the size,
and the uuid or the bytes' hash names it (path "data"); anything else ends the exact prefix at this
item's placeholder (path "prefix_only").

http(s) URLs are not fetched: fetching would put the router on the media host's latency and make it an
outbound client for untrusted URLs.  Bad bytes (broken base64, an undecodable image, a data URL that is
not base64) are refused the way vLLM refuses them (``MediaError``: a 400).
"""

from __future__ import annotations

import binascii
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import pybase64

from ..errors import ChatTemplateError, UnsupportedContentError
from .hasher import HashAlgorithm, ImageBytes, hash_kwargs
from .image_header import ImageInfo, ImageReadError, ImageTooLarge, probe_image

__all__ = ["ItemPath", "MediaError", "MediaRef", "MediaResolver", "Resolved", "data_url_bytes"]

ItemPath = Literal["uuid", "uuid_cached", "data", "prefix_only"]
Modality = Literal["image", "audio", "video"]

# vLLM's conversion of a loaded image (ImageMediaIO defaults), part of the hash when it made a new image.
_IO_CONFIG: Mapping[str, Any] = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}


class MediaError(ChatTemplateError):
    """Media vLLM refuses with a 400 (bad base64, an image it cannot load, a data URL that is not base64)."""


class MediaRef(NamedTuple):
    """One media part of the prompt, in order."""

    modality: Modality
    url: str | None
    uuid: str | None


class Resolved(NamedTuple):
    """What the router knows of one item: its identifier (None: unknown), its size (None: unknown or not
    needed), and the path that told it."""

    identifier: str | None
    info: ImageInfo | None
    path: ItemPath


def data_url_bytes(url: str) -> bytes:
    """The bytes of a ``data:`` URL as vLLM's connector decodes them (``MediaError`` where it fails)."""
    spec, sep, data = url[5:].partition(",")
    if not sep:
        raise MediaError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    _, sep, encoding = spec.rpartition(";")
    if not sep or encoding != "base64":  # vLLM answers 501 (NotImplementedError): route it, it decides
        raise UnsupportedContentError("Only base64 data URLs are supported for now.", "media_not_base64")
    try:
        return bytes(pybase64.b64decode(data, validate=True))  # vLLM's own decoder, and its checks
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"Failed to decode base64 media: {e}") from None


class MediaResolver:
    """Resolves one model's media items; thread-safe.  ``model_id``: vLLM's ``--model`` as given (it is
    hashed with every item's bytes); ``sized``: whether the model's placeholder count needs the size."""

    def __init__(
        self,
        model_id: str,
        *,
        sized: bool,
        algorithm: HashAlgorithm = "blake3",
        max_image_pixels: int = 0,
        uuid_sizes: int = 65536,
    ) -> None:
        self.model_id = model_id
        self.sized = sized
        self.algorithm: HashAlgorithm = algorithm
        self.max_image_pixels = max_image_pixels
        # Per uuid whose size was seen, the answer for its next sighting without bytes (LRU).
        self._seen: OrderedDict[str, Resolved] = OrderedDict()
        self._cap = uuid_sizes
        self._lock = threading.Lock()

    def _remember(self, uuid: str, info: ImageInfo) -> None:
        with self._lock:
            self._seen[uuid] = Resolved(uuid, info, "uuid_cached")
            self._seen.move_to_end(uuid)
            while len(self._seen) > self._cap:
                self._seen.popitem(last=False)

    def _recall(self, uuid: str) -> Resolved | None:
        with self._lock:
            got = self._seen.get(uuid)
            if got is not None:
                self._seen.move_to_end(uuid)
            return got

    def _named(self, uuid: str) -> Resolved:
        """An image known only by its uuid: exact when its size was seen with its bytes, else the prefix."""
        seen = self._recall(uuid)
        return seen if seen is not None else Resolved(uuid, None, "prefix_only")

    def resolve(self, ref: MediaRef) -> Resolved:
        url = ref.url
        if url is None and ref.uuid is not None and self.sized and ref.modality == "image":
            return self._named(ref.uuid)  # the common item: a uuid, its size seen before
        if ref.modality != "image":
            return Resolved(None, None, "prefix_only")
        if url and url[:5].lower() == "data:":
            data = data_url_bytes(url)
            try:
                info = probe_image(data, max_pixels=self.max_image_pixels)
            except ImageTooLarge as e:  # what vLLM answers was not recorded: let it answer
                raise UnsupportedContentError(str(e), "media_too_large") from None
            except ImageReadError as e:
                raise MediaError(str(e)) from None
            if ref.uuid is not None:
                self._remember(ref.uuid, info)
                return Resolved(ref.uuid, info, "data")
            item = ImageBytes(data, _IO_CONFIG if info.converted else None)
            return Resolved(hash_kwargs(self.algorithm, model_id=self.model_id, image=item), info, "data")
        if ref.uuid is None:
            return Resolved(None, None, "prefix_only")
        if not self.sized:
            return Resolved(ref.uuid, None, "uuid")
        return self._named(ref.uuid)
