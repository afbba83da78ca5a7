"""What vLLM's image loading decides about an image, read from its header (no pixels decoded).

vLLM (``multimodal/media/image.py``) opens the bytes with Pillow (a fixed list of formats), refuses more
than ``VLLM_MAX_IMAGE_PIXELS``, turns the image upright by its EXIF orientation (errors ignored) and
converts it to RGB, composing on white whatever has transparency.  The processor sees the upright size; the
hash sees the original bytes, plus the conversion when one made a new image.  All of that is in the header:
Pillow's ``open`` reads only up to the pixel data (JPEG markers, PNG chunks before IDAT, GIF's first frame
header, WebP's chunks), and so does this module.  Exception: an EXIF orientation or transparency announced
after PNG's pixel data (a rare file) is found by walking the chunk headers, not by decoding.
"""

from __future__ import annotations

import io
import re
import struct
from typing import NamedTuple

from PIL import Image, UnidentifiedImageError

__all__ = ["ALLOWED_IMAGE_FORMATS", "ImageInfo", "ImageReadError", "ImageTooLarge", "probe_image"]

# vLLM 0.33's allow-list for untrusted media (multimodal/image.py).
ALLOWED_IMAGE_FORMATS = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS", "ICO",
    "IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG", "PPM", "PSD",
    "QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB",
)  # fmt: skip
_ORIENTATION = 0x0112
_SWAPS = frozenset({5, 6, 7, 8})
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(?:="|>)([0-9])')
_LATE_PNG_CHUNKS = frozenset({b"eXIf", b"tEXt", b"zTXt", b"iTXt", b"tRNS"})


class ImageReadError(ValueError):
    """Bytes vLLM cannot load as an image ("Failed to load image": a 400)."""


class ImageTooLarge(ImageReadError):
    """More pixels than Pillow's decompression-bomb limit or ``VLLM_MAX_IMAGE_PIXELS``."""


class ImageInfo(NamedTuple):
    """What vLLM's loader makes of an image: the upright size and whether converting it to RGB made a new
    image (then its hash covers the conversion)."""

    width: int
    height: int
    converted: bool


def _orientation(im: Image.Image) -> int:
    """The EXIF orientation ``ImageOps.exif_transpose`` would act on (1 when none or unreadable)."""
    try:
        exif = Image.Image.getexif(im)  # the base method: PNG's own would decode the pixels first
        value = exif.get(_ORIENTATION)
        if value is None:
            xmp = im.info.get("xmp") or im.info.get("XML:com.adobe.xmp")
            if isinstance(xmp, str):
                xmp = xmp.encode()
            if isinstance(xmp, bytes) and (m := _XMP_ORIENTATION.search(xmp)):
                value = int(m.group(1))
        return int(value) if value is not None else 1
    except Exception:  # vLLM ignores any error of the EXIF path
        return 1


def _png_late_chunks(data: bytes) -> bool:
    """Whether a PNG has metadata after its first IDAT chunk (Pillow reads those only when decoding)."""
    pos = 8
    seen_idat = False
    n = len(data)
    while pos + 8 <= n:
        (length,) = struct.unpack_from(">I", data, pos)
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            seen_idat = True
        elif seen_idat and kind in _LATE_PNG_CHUNKS:
            return True
        elif kind == b"IEND":
            return False
        pos += 12 + length
    return False


def _has_transparency(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info


def probe_image(data: bytes, *, max_pixels: int = 0) -> ImageInfo:
    """The image's upright size and conversion, from its header.  Raises ``ImageReadError`` for bytes
    vLLM cannot load (unknown or disallowed format, a broken header, more than ``max_pixels``)."""
    try:
        im = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
        if im.format == "PNG" and _png_late_chunks(data):
            im.load()  # the rare PNG whose metadata follows its pixels: as vLLM reads it
    except Image.DecompressionBombError as e:
        raise ImageTooLarge(str(e)) from None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        raise ImageReadError(f"Failed to load image: {e}") from None
    w, h = im.size
    if max_pixels > 0 and w * h > max_pixels:
        raise ImageTooLarge(
            f"Image dimensions {w}x{h} ({w * h} pixels) exceed the maximum of {max_pixels} pixels."
        )
    if _orientation(im) in _SWAPS:
        w, h = h, w
    converted = _has_transparency(im) or im.mode != "RGB"
    return ImageInfo(w, h, converted)
