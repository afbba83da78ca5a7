"""Placeholder expansion per processor family, with the numbers read from the model directory.

vLLM tokenizes the rendered text, then replaces each image's placeholder token with the item's tokens
(docs/multimodal.md, section 4).  A family knows its placeholder text (what a "string"-format message
gets), the token it replaces, and the replacement for an image of a given size::

    Qwen2-VL, Qwen2.5-VL   <|image_pad|>     -> <|image_pad|> x (grid_h * grid_w / merge_size**2)
                                                 grid from smart_resize(height, width)
    Gemma 3                <start_of_image>  -> tokens of "\\n\\n<start_of_image>" + <image_soft_token> x
                                                 image_seq_length + "<end_of_image>\\n\\n" (per crop when
                                                 pan-and-scan is on), then newline tokens merged

Configuration comes from the files transformers reads (``config.json``, ``preprocessor_config.json``,
``processor_config.json``) and the server's ``--mm-processor-kwargs``, with transformers' defaults.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from .image_header import ImageInfo

__all__ = ["Expansion", "Family", "UnknownProcessor", "load_family", "smart_resize"]

EncodeFn = Callable[[str], list[int]]
"""Text to ids without special tokens (the model's tokenizer)."""


class UnknownProcessor(LookupError):
    """The model directory describes no processor family this module reproduces."""


class Expansion(NamedTuple):
    """The expanded prompt: ids, and each image's placeholder range ``(offset, length)`` in them."""

    ids: list[int]
    ranges: list[tuple[int, int]]


class Family(Protocol):
    name: str
    placeholder: str
    """What vLLM puts in a "string"-format message for an image (``get_placeholder_str``)."""
    target: int
    """The token id each image replaces."""
    others: Mapping[str, tuple[str, int]]
    """Other modalities of the model: their placeholder text and the token each item replaces (rendered,
    never expanded here: the prompt is exact up to their first item)."""
    sized: bool
    """Whether an image's token count depends on its size (False: any image expands alike)."""

    def replacement(self, info: ImageInfo | None) -> list[int]:
        """The ids an image of this size becomes: a list kept for the next image of the size, so callers
        only read it."""

    def expand(self, ids: Sequence[int], images: Sequence[ImageInfo | None]) -> Expansion | None:
        """The ids with the first ``len(images)`` targets replaced, in order; None when the prompt has fewer
        targets than images (vLLM then falls back to a text-level update: not reproduced)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL resize target (Python's ``round``, as there)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# Replacement lists kept per family (one per image size seen; dropped all at once past this many).
_KEEP_SIZES = 4096


def _replace_in_order(
    ids: Sequence[int], target: int, repls: Sequence[list[int]]
) -> tuple[list[int], list[tuple[int, int]]] | None:
    if len(repls) == 1:  # the common request: one image, its target replaced in a copy
        one = list(ids)
        try:
            at = one.index(target)
        except ValueError:
            return None
        one[at : at + 1] = repls[0]
        return one, [(at, len(repls[0]))]
    out: list[int] = []
    ranges: list[tuple[int, int]] = []
    pos = 0
    src = list(ids)
    for repl in repls:
        try:
            at = src.index(target, pos)
        except ValueError:
            return None
        out.extend(src[pos:at])
        ranges.append((len(out), len(repl)))
        out.extend(repl)
        pos = at + 1
    out.extend(src[pos:])
    return out, ranges


class QwenVL:
    """Qwen2-VL / Qwen2.5-VL (vLLM ``qwen2_vl.py``; transformers ``Qwen2VLImageProcessor``)."""

    name = "qwen2_vl"
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    sized = True

    def __init__(
        self, target: int, pre: Mapping[str, Any], kwargs: Mapping[str, Any], video: int | None = None
    ) -> None:
        self.others: Mapping[str, tuple[str, int]] = (
            {} if video is None else {"video": ("<|vision_start|><|video_pad|><|vision_end|>", video)}
        )
        cfg = {**pre, **kwargs}
        size = dict(cfg.get("size") or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
        if cfg.get("min_pixels") is not None:
            size["shortest_edge"] = cfg["min_pixels"]
        if cfg.get("max_pixels") is not None:
            size["longest_edge"] = cfg["max_pixels"]
        self.target = target
        self.min_pixels = int(size["shortest_edge"])
        self.max_pixels = int(size["longest_edge"])
        self.patch = int(cfg.get("patch_size", 14))
        self.merge = int(cfg.get("merge_size", 2))
        self.do_resize = bool(cfg.get("do_resize", True))
        self._repl: dict[ImageInfo, list[int]] = {}

    def count(self, info: ImageInfo) -> int:
        h, w = info.height, info.width
        if self.do_resize:
            h, w = smart_resize(h, w, self.patch * self.merge, self.min_pixels, self.max_pixels)
        return (h // self.patch) * (w // self.patch) // (self.merge * self.merge)

    def replacement(self, info: ImageInfo | None) -> list[int]:
        if info is None:
            raise ValueError("Qwen-VL needs the image's size")
        got = self._repl.get(info)
        if got is None:
            got = [self.target] * self.count(info)  # raises for an aspect ratio above 200: not kept
            if len(self._repl) >= _KEEP_SIZES:
                self._repl.clear()
            self._repl[info] = got
        return got

    def expand(self, ids: Sequence[int], images: Sequence[ImageInfo | None]) -> Expansion | None:
        got = _replace_in_order(ids, self.target, [self.replacement(i) for i in images])
        return None if got is None else Expansion(*got)


class Gemma3:
    """Gemma 3 (vLLM ``gemma3_mm.py``; transformers ``Gemma3Processor``).  Pan-and-scan settings come from
    the processor's call defaults and the server's ``--mm-processor-kwargs`` only: vLLM reads them through
    the processor's kwarg merge, where those defaults hide the image processor's own values."""

    name = "gemma3"
    placeholder = "<start_of_image>"
    others: Mapping[str, tuple[str, int]] = {}

    def __init__(
        self, encode: EncodeFn, vocab: Mapping[str, int], proc: Mapping[str, Any], kwargs: Mapping[str, Any]
    ):
        self._encode = encode
        self.target = vocab["<start_of_image>"]
        self.seq_len = int(proc.get("image_seq_length", 256))
        self.full = f"\n\n<start_of_image>{'<image_soft_token>' * self.seq_len}<end_of_image>\n\n"
        self.pan_scan = bool(kwargs.get("do_pan_and_scan", False))
        self.min_crop = int(kwargs.get("pan_and_scan_min_crop_size", 256))
        self.max_crops = int(kwargs.get("pan_and_scan_max_num_crops", 4))
        self.min_ratio = float(kwargs.get("pan_and_scan_min_ratio_to_activate", 1.2))
        self.sized = self.pan_scan
        self.nl = [vocab["\n"], vocab["\n\n"], vocab["\n\n\n"], vocab["\n\n\n\n"]]
        self._repl: dict[int, list[int]] = {}

    def crops(self, w: int, h: int) -> int:
        if not self.pan_scan:
            return 0
        if w >= h:
            if w / h < self.min_ratio:
                return 0
            nw = max(2, min(math.floor(w / self.min_crop), math.floor(w / h + 0.5)))
            nw, nh = min(self.max_crops, nw), 1
        else:
            if h / w < self.min_ratio:
                return 0
            nh = max(2, min(math.floor(h / self.min_crop), math.floor(h / w + 0.5)))
            nw, nh = 1, min(self.max_crops, nh)
        if min(math.ceil(w / nw), math.ceil(h / nh)) < self.min_crop:
            return 0
        return nw * nh

    def replacement(self, info: ImageInfo | None) -> list[int]:
        if info is None and self.pan_scan:
            raise ValueError("pan-and-scan needs the image's size")
        n = 0 if info is None else self.crops(info.width, info.height)
        got = self._repl.get(n)
        if got is None:
            if n == 0:
                text = "<start_of_image>"
            else:
                crops = " ".join("<start_of_image>" for _ in range(n))
                text = (
                    "Here is the original image <start_of_image> and here are some crops to help you see "
                    f"better {crops}"
                )
            got = self._repl[n] = self._encode(text.replace("<start_of_image>", self.full))
        return got

    def expand(self, ids: Sequence[int], images: Sequence[ImageInfo | None]) -> Expansion | None:
        repls = [self.replacement(i) for i in images]
        got = _replace_in_order(ids, self.target, repls)
        if got is None:
            return None
        out = _merge_newlines(got[0], self.nl)
        return Expansion(out, _find_ranges(out, repls, self.nl))


def _merge_newlines(ids: list[int], nl: list[int]) -> list[int]:
    """vLLM's three passes over the whole prompt: newline-token pairs (1, 2) and (2, 1) become the
    three-newline token, then (2, 2) the four-newline token; each pass left to right, not overlapping."""
    n1, n2, n3, n4 = nl
    for a, b, c in ((n1, n2, n3), (n2, n1, n3), (n2, n2, n4)):
        out: list[int] = []
        i = 0
        while i < len(ids):
            if i + 1 < len(ids) and ids[i] == a and ids[i + 1] == b:
                out.append(c)
                i += 2
            else:
                out.append(ids[i])
                i += 1
        ids = out
    return ids


def _find_ranges(ids: list[int], repls: Sequence[list[int]], nl: list[int]) -> list[tuple[int, int]]:
    """Each replacement's start, found in the ids with merged newlines split again and mapped back (vLLM's
    ``Gemma3MultiModalProcessor._find_mm_placeholders``); the length is the replacement's."""
    n1, n2, n3, n4 = nl
    flat: list[int] = []
    orig: list[int] = []
    for i, t in enumerate(ids):
        parts = [n1, n2] if t == n3 else [n2, n2] if t == n4 else [t]
        flat.extend(parts)
        orig.extend([i] * len(parts))
    ranges: list[tuple[int, int]] = []
    pos = 0
    for repl in repls:
        k = len(repl)
        while pos + k <= len(flat) and not (flat[pos] == repl[0] and flat[pos : pos + k] == repl):
            pos += 1
        if pos + k > len(flat):
            raise ValueError("an image's placeholder tokens were not found after expansion")
        ranges.append((orig[pos], k))
        pos += k
    return ranges


def _read(directory: Path, name: str) -> dict[str, Any]:
    p = directory / name
    if not p.is_file():
        return {}
    value = json.loads(p.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def load_family(
    directory: str | Path,
    vocab: Mapping[str, int],
    encode: EncodeFn,
    mm_processor_kwargs: Mapping[str, Any] | None = None,
) -> Family:
    """The processor family of the model at ``directory`` (``config.json``'s ``model_type``), configured
    from its processor files and the server's ``--mm-processor-kwargs``.  ``UnknownProcessor`` otherwise."""
    d = Path(directory)
    config = _read(d, "config.json")
    kind = str(config.get("model_type", ""))
    kwargs = dict(mm_processor_kwargs or {})
    pre = _read(d, "preprocessor_config.json")
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        return QwenVL(vocab["<|image_pad|>"], pre, kwargs, vocab.get("<|video_pad|>"))
    if kind == "gemma3":
        return Gemma3(encode, vocab, _read(d, "processor_config.json"), kwargs)
    raise UnknownProcessor(f"no multimodal processor reproduced for model_type {kind!r} at {d}")
