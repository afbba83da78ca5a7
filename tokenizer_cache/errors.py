"""The errors this package raises, as one small tree.

::

    TokenizerCacheError            base class: catch this to handle every failure of the package
    ├── TokenizerLoadError         the tokenizer cannot be loaded (missing files, not offline, not "fast",
    │                              no tokenizer configured for a model, unreadable chat template file)
    ├── InvalidPromptError         a prompt is neither text nor a list of token ids of this vocabulary
    └── ChatTemplateError          a chat request cannot be rendered: no chat template, the template
        │                          raised, a message has the wrong shape, or the request's template
        │                          arguments are contradictory
        ├── NoChatTemplateError    no chat template anywhere (configuration, not the request's fault)
        └── RequestValidationError the request body is one vLLM's request model refuses (a field of the
                                   wrong type, a message no message type accepts, contradictory flags)

``InvalidPromptError`` and ``ChatTemplateError`` describe a bad *request*: the HTTP layers answer them with
a 400 and the message text.  ``TokenizerLoadError`` is a configuration problem (a 500 or a startup failure).
"""

from __future__ import annotations

__all__ = [
    "ChatTemplateError",
    "InvalidPromptError",
    "NoChatTemplateError",
    "RequestValidationError",
    "TokenizerCacheError",
    "TokenizerLoadError",
    "UnsupportedContentError",
]


class TokenizerCacheError(Exception):
    """Base class of every error raised by ``tokenizer_cache``."""


class TokenizerLoadError(TokenizerCacheError):
    """A tokenizer (or a chat template file) could not be loaded as configured."""


class InvalidPromptError(TokenizerCacheError):
    """A prompt is not text and not a list of in-vocabulary token ids (a client error, HTTP 400)."""


class ChatTemplateError(TokenizerCacheError):
    """A chat request could not be rendered with the chat template (a client error, HTTP 400)."""


class NoChatTemplateError(ChatTemplateError):
    """Neither the tokenizer, the configuration nor the request has a chat template.  vLLM may still have
    one (``--chat-template``), so a router can route such a request without token ids instead of refusing."""


class RequestValidationError(ChatTemplateError):
    """The request body is one vLLM refuses before rendering it (its request model or validators: 400)."""


class UnsupportedContentError(ChatTemplateError):
    """A request vLLM accepts but the router cannot reproduce (media it cannot expand, options it does not
    reproduce); the gateway routes such a request without token ids, counted by ``reason``."""

    def __init__(self, message: str, reason: str = "unsupported") -> None:
        super().__init__(message)
        self.reason = reason
