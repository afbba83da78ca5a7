"""One ``CachedTokenizer`` per served model, as configured in the fleet file.

The fleet file names a tokenizer for the whole fleet and may override it per model::

    tokenizer: /models/deepseek-v3          # default for every model
    chat_template: /etc/templates/ds.jinja  # optional, like vLLM's --chat-template
    models:
      small-llama:
        tokenizer: /models/llama-3.2-1b
        chat_template: ...                  # optional, per model
      qwen-vl:
        tokenizer: /models/qwen2.5-vl-7b     # a multimodal model: its processor files are read too
        model_id: Qwen/Qwen2.5-VL-7B-Instruct   # vLLM's --model (images are hashed with it)

The registry takes those values as plain dicts and strings (parsing the file is the caller's job) and
loads each tokenizer on first use.  Models that resolve to the same (tokenizer, chat template) pair
share one ``CachedTokenizer`` and therefore one prefix cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

from .cached import CachedTokenizer
from .config import CacheConfig, RenderOptions
from .errors import TokenizerLoadError

__all__ = ["Loader", "TokenizerRegistry"]

Loader = Callable[[str, "str | None", "str | None", "TokenizerRegistry"], CachedTokenizer]
"""Builds the tokenizer for a (tokenizer path, chat template, multimodal model id) with the registry's
settings (``TokenizerRegistry.load``).  The
default loads it from files; a caller that runs many registries in one process (a test session) may
hand out tokenizers it keeps itself, which the registry then never closes."""


class TokenizerRegistry:
    """Lazily loaded tokenizers by model name; ``get`` is thread-safe and loads each one once."""

    def __init__(
        self,
        default: str | None,
        per_model: Mapping[str, str] | None = None,
        *,
        chat_template: str | None = None,
        per_model_chat_template: Mapping[str, str] | None = None,
        config: CacheConfig | None = None,
        allow_download: bool = False,
        executor: Executor | None = None,
        render_options: RenderOptions | None = None,
        model_ids: Mapping[str, str] | None = None,
        loader: Loader | None = None,
    ) -> None:
        """``model_ids``: per model, vLLM's ``--model`` (multimodal item hashes; default the tokenizer)."""
        self.default = default
        self.model_ids = dict(model_ids or {})
        self.render_options = render_options
        self.per_model = dict(per_model or {})
        self.chat_template = chat_template
        self.per_model_chat_template = dict(per_model_chat_template or {})
        self.config = (config or CacheConfig()).validate()
        self.allow_download = allow_download
        self._executor = executor
        self._loader = loader
        self._lock = threading.Lock()
        self._loaded: dict[tuple[str, str | None, str | None], CachedTokenizer] = {}
        self._loading: dict[tuple[str, str | None, str | None], threading.Lock] = {}

    @classmethod
    def from_fleet(cls, fleet: Mapping[str, Any], **kwargs: Any) -> TokenizerRegistry:
        """Build from a parsed fleet file: top-level ``tokenizer`` / ``chat_template`` and ``models``."""
        per_model: dict[str, str] = {}
        templates: dict[str, str] = {}
        ids: dict[str, str] = {}
        models = fleet.get("models") or {}
        if not isinstance(models, Mapping):
            raise TokenizerLoadError("the fleet file's 'models' must be a mapping")
        for name, spec in models.items():
            if not isinstance(spec, Mapping):
                continue
            if spec.get("tokenizer"):
                per_model[str(name)] = str(spec["tokenizer"])
            if spec.get("chat_template"):
                templates[str(name)] = str(spec["chat_template"])
            if spec.get("model_id"):
                ids[str(name)] = str(spec["model_id"])
        default = fleet.get("tokenizer")
        return cls(
            str(default) if default else None,
            per_model,
            chat_template=fleet.get("chat_template"),
            per_model_chat_template=templates,
            model_ids=ids,
            **kwargs,
        )

    def resolve(self, model: str | None) -> tuple[str, str | None]:
        """The (tokenizer path, chat template) configured for ``model`` (None: the fleet default)."""
        path = self.per_model.get(model, self.default) if model is not None else self.default
        if path is None:
            raise TokenizerLoadError(f"no tokenizer is configured for model {model!r}")
        template = (
            self.per_model_chat_template.get(model, self.chat_template) if model else self.chat_template
        )
        return path, template

    def get(self, model: str | None = None) -> CachedTokenizer:
        """The model's tokenizer, loading it on first use (raises ``TokenizerLoadError``)."""
        key = (*self.resolve(model), self.model_ids.get(model) if model is not None else None)
        with self._lock:
            tok = self._loaded.get(key)
            if tok is not None:
                return tok
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:  # one loader per key; others for the same key wait, other keys proceed
            with self._lock:
                tok = self._loaded.get(key)
            if tok is None:
                tok = self._loader(*key, self) if self._loader is not None else self.load(*key)
                with self._lock:
                    self._loaded[key] = tok
            return tok

    def load(self, path: str, chat_template: str | None, mm_model_id: str | None = None) -> CachedTokenizer:
        """A new tokenizer from ``path``'s files with this registry's settings (the default loader);
        ``mm_model_id``: the served model's ``--model``, which vLLM hashes with every media item."""
        return CachedTokenizer.from_pretrained(
            path,
            allow_download=self.allow_download,
            chat_template=chat_template,
            config=self.config,
            executor=self._executor,
            render_options=self.render_options,
            mm_model_id=mm_model_id,
        )

    def loaded(self) -> dict[str, CachedTokenizer]:
        """Tokenizers loaded so far, by tokenizer path (and template, when one is set)."""
        with self._lock:
            return {p if t is None else f"{p} [{t[:32]}]": tok for (p, t, _), tok in self._loaded.items()}

    def close(self) -> None:
        """Close every tokenizer this registry loaded itself (their executors); a custom loader's are its
        own to close."""
        if self._loader is not None:
            return
        with self._lock:
            toks = list(self._loaded.values())
        for tok in toks:
            tok.close()
