"""A rendered multimodal prompt's ids as vLLM expands them, with each item's identifier and range.

``MultimodalModel.expand(ids, refs)``: resolve every item (``items.MediaResolver``), expand the placeholders
of the resolved leading items (``processors``), and stop at the first item the router cannot complete::

    ids (placeholders unexpanded) ──resolve items──▶ k leading items known
        ──family.expand(first k)──▶ ids', ranges ──[k < n: cut before item k's placeholder]──▶ MMPrompt

Cut before an unknown item, the prompt is still exact: a block's key depends only on its tokens, its
parent and the items it overlaps, none of which the unknown item changes before its own placeholder (one
token more is dropped for Gemma 3, whose newline merge may join the token before a placeholder).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import UnsupportedContentError
from .hasher import HashAlgorithm
from .items import ItemPath, MediaError, MediaRef, MediaResolver
from .processors import Family, load_family

__all__ = ["MMItem", "MMPrompt", "MultimodalModel"]


class MMItem(NamedTuple):
    """vLLM's identifier of an item and its placeholder range in the prompt's ids (``MMFeatureSpec``)."""

    identifier: str
    offset: int
    length: int


class MMPrompt(NamedTuple):
    ids: list[int]
    items: tuple[MMItem, ...]
    paths: tuple[ItemPath, ...]
    """How each item of the request was learnt (in order; items past a cut included)."""
    complete: bool
    """False: ``ids`` stop before an item the router cannot expand (a prefix of vLLM's ids)."""


class MultimodalModel:
    """One model's processor family and item resolver."""

    def __init__(self, family: Family, resolver: MediaResolver) -> None:
        self.family = family
        self.resolver = resolver
        self.placeholders = {"image": family.placeholder, **{m: p for m, (p, _) in family.others.items()}}
        self.paths: Counter[str] = Counter()

    @classmethod
    def load(
        cls,
        directory: str | Path,
        tok: Any,
        *,
        model_id: str,
        mm_processor_kwargs: dict[str, Any] | None = None,
        algorithm: HashAlgorithm = "blake3",
        max_image_pixels: int = 0,
    ) -> MultimodalModel:
        """From the model directory (``processors.load_family``); ``tok``: its transformers tokenizer."""

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

        family = load_family(directory, tok.get_vocab(), encode, mm_processor_kwargs)
        resolver = MediaResolver(
            model_id, sized=family.sized, algorithm=algorithm, max_image_pixels=max_image_pixels
        )
        return cls(family, resolver)

    def expand(self, ids: Sequence[int], refs: Sequence[MediaRef]) -> MMPrompt:
        resolve = self.resolver.resolve
        resolved = [resolve(r) for r in refs]
        paths = tuple([r.path for r in resolved])
        counts = self.paths
        for p in paths:
            counts[p] += 1
        known = paths.index("prefix_only") if "prefix_only" in paths else len(paths)
        fam = self.family
        complete = known == len(resolved)
        if not complete:
            modality = refs[known].modality
            target = fam.target if modality == "image" else fam.others[modality][1]
            before = sum(1 for r in refs[:known] if r.modality == modality)
            at = [i for i, t in enumerate(ids) if t == target]
            if len(at) <= before:
                raise UnsupportedContentError(
                    "an image's placeholder is missing from the rendered prompt", "media_placeholders"
                )
            ids = ids[: at[before]]
        try:
            got = fam.expand(ids, [r.info for r in resolved[:known]])
        except ValueError as e:  # a size the processor refuses (aspect ratio above 200): vLLM's 400
            raise MediaError(f"Failed to apply the processor: {e}") from None
        if got is None:
            raise UnsupportedContentError(
                "fewer image placeholders in the rendered prompt than images", "media_placeholders"
            )
        out, ranges = got
        items = []
        for r, (off, n) in zip(resolved[:known], ranges, strict=True):
            if r.identifier is not None:
                items.append(MMItem(r.identifier, off, n))
        if not complete and fam.name == "gemma3" and out:
            out = out[:-1]  # the newline merge may join the last token with the next image's
        return MMPrompt(out, tuple(items), paths, complete)
