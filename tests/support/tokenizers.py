"""Tokenizers loaded once per test process and shared by every in-process gateway.

Loading the default tokenizer and building its ``CachedTokenizer`` takes seconds (far more on a busy
machine); the suite starts dozens of gateways.  ``SHARED`` is a ``tokenizer_cache.Loader``: the first
registry asking for a (tokenizer, chat template, settings) combination loads it from its files, later
ones get the same object.  Its prefix cache is shared too, which is what a long-running gateway's cache
is like anyway; tests that need a cold tokenizer build their registry without a loader (as
``kvrouter serve`` does).
"""

from __future__ import annotations

import threading

from tokenizer_cache import CachedTokenizer, TokenizerRegistry


class SharedTokenizers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[tuple[str, str | None, str | None, str, str], CachedTokenizer] = {}

    def __call__(
        self, path: str, chat_template: str | None, model_id: str | None, registry: TokenizerRegistry
    ) -> CachedTokenizer:
        key = (path, chat_template, model_id, repr(registry.config), repr(registry.render_options))
        with self._lock:
            tok = self._loaded.get(key)
            if tok is None:
                tok = self._loaded[key] = registry.load(path, chat_template, model_id)
            return tok


SHARED = SharedTokenizers()
