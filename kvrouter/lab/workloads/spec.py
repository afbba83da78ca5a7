"""The request and workload types fed to ``kvrouter eval`` and to the live demo.

A prompt is held lazily, as *segments*: each names a deterministic token stream (its ``key``) and how
many of its leading tokens are used; ``Segment(k_sys, 6000), Segment(k_q17, 1200)`` is
``stream(k_sys)[:6000] ++ stream(k_q17)[:1200]``.  Equal keys give equal tokens, so two prompts share a
token-level prefix exactly when they share leading segments; a workload never holds its prompts as
Python ints, and block hashes are cached per segment key (``blocks.py``).

A request is in one of three forms:

* tokens:    ``segments`` set (synthetic workloads, Mooncake traces);
* explicit:  ``token_ids`` set (after ``materialize``, or built by hand);
* text:      ``text`` or ``messages`` set, no token ids yet: ``materialize`` them with the model's
             tokenizer before simulating.  ``num_prompt_tokens`` is then only an estimate (one word per
             token).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import msgspec
from msgspec import Struct

Role = Literal["system", "user", "assistant"]


class Segment(Struct, frozen=True, array_like=True, gc=False):
    """The first ``length`` tokens of the deterministic stream ``key`` (see ``tokens.stream_tokens``)."""

    key: int
    """Stream id, 0 <= key < 2**64; derived from the workload's seed and what the segment stands for."""
    length: int
    """Number of leading tokens of the stream used (>= 0)."""


class MediaItem(NamedTuple):
    """One multimodal item (an image) of a tokens-form prompt: vLLM's identifier for it (its bytes' hash,
    or the client's ``uuid``) and its placeholder range in the prompt's tokens.

    The placeholder tokens are the prompt's own (a segment of the workload's placeholder stream, the
    same for every image, as vLLM's pad tokens are): only the identifier tells two images apart, through
    the blocks' extra keys (``indexer.extra_keys``).  A tuple: what the engine and ``indexer.extra_keys``
    take for an item."""

    identifier: str
    offset: int
    """First placeholder token's position in the prompt."""
    length: int
    """Placeholder tokens (the image's size decides them)."""


class ChatMessage(Struct, frozen=True, gc=False):
    """One OpenAI-style chat message."""

    role: Role
    content: str


class TokenSpace(Struct, frozen=True, kw_only=True):
    """Which token ids synthetic streams draw from: ``low <= id < vocab_size``, minus ``excluded``.

    The defaults fit Llama 3 (special ids start at 128000) and Qwen (151643); ``low`` skips the ids most
    vocabularies give to control and byte tokens.  Set ``vocab_size`` to the served model's for live runs
    that send token ids."""

    vocab_size: int = 128_000
    """One past the largest id a stream may emit."""
    low: int = 1000
    """Smallest id a stream may emit."""
    excluded: tuple[int, ...] = ()
    """Ids in ``[low, vocab_size)`` never emitted (special tokens of the served model)."""


class OpenLoop(Struct, frozen=True, tag="open-loop", tag_field="type"):
    """Requests arrive at their ``arrival_s`` whatever the fleet does."""


class ClosedLoop(Struct, frozen=True, tag="closed-loop", tag_field="type"):
    """``concurrency`` clients: whenever one finishes a request it sends the first request, in list order,
    not sent yet and whose ``depends_on`` (if any) finished at least ``think_s`` ago.

    Multi-turn workloads list conversations one after the other, so the clients behave like users each
    running a conversation to its end before taking the next."""

    concurrency: int
    """Number of requests in flight at any time (>= 1)."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


ArrivalMode = OpenLoop | ClosedLoop


class Request(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One request of a workload."""

    id: str
    """Unique within the workload."""
    arrival_s: float | None
    """Seconds from the start of the run; None in closed-loop workloads."""
    max_output_tokens: int
    """Tokens to generate (sent as ``max_tokens`` with ``ignore_eos``)."""
    num_prompt_tokens: int
    """Prompt length in tokens; an estimate (words) for text requests until materialized."""
    segments: tuple[Segment, ...] = ()
    """Lazy prompt tokens (tokens form)."""
    token_ids: list[int] | None = None
    """Explicit prompt tokens (explicit form); wins over ``segments``."""
    text: str | None = None
    """Prompt text for ``/v1/completions`` (text form)."""
    messages: tuple[ChatMessage, ...] | None = None
    """Chat messages for ``/v1/chat/completions`` (text form)."""
    output_segments: tuple[Segment, ...] = ()
    """The tokens a simulated engine should generate, when a later prompt contains them (multi-turn chat):
    an engine that emits exactly these caches decode blocks that the next turn can hit.  Empty: any."""
    items: tuple[MediaItem, ...] = ()
    """Multimodal items of a tokens-form prompt, in offset order: keyed into its blocks as vLLM keys them,
    and encoded by the engine when its prefill reaches them uncached."""
    cache_salt: str | None = None
    """vLLM ``cache_salt``: requests under different salts never share cache blocks."""
    tenant: str | None = None
    """Who sent it, for per-tenant figures."""
    session_id: str | None = None
    """Conversation id of a multi-turn request."""
    turn: int = 0
    """Turn number within the session, from 0."""
    depends_on: str | None = None
    """Id of a request that must have finished before this one is sent (the previous turn).  An evaluator
    honouring it sends the request at ``max(arrival_s, finish(depends_on) + think_s)`` in open loop, and
    as the closed-loop rule says otherwise."""
    think_s: float = 0.0
    """Delay after ``depends_on`` finished before this request is sent."""
    affinity_id: str | None = None
    """Client affinity key: SageMaker ``X-Amzn-SageMaker-Prefix-Aware-Id`` / OpenAI ``prompt_cache_key``."""
    group: str | None = None
    """Which shared prefix the prompt belongs to, for analysis only."""


class Workload(Struct, frozen=True, kw_only=True):
    """A named, fully generated list of requests plus how they are to be released."""

    name: str
    requests: list[Request]
    """In release order: sorted by ``arrival_s`` (open loop) or the order clients send them (closed)."""
    mode: ArrivalMode
    token_space: TokenSpace
    """The id range the segments' streams draw from."""
    metadata: dict[str, Any]
    """JSON data: the generator's parameters (``params``), evaluator hints (``hints``, e.g. the peer's
    instance count), and whatever the loader adds (``source``, ``materialized``)."""

    @property
    def closed_loop(self) -> bool:
        return isinstance(self.mode, ClosedLoop)


def plain(value: Any) -> Any:
    """``value`` as JSON data (dicts, lists, str, numbers, None): what ``metadata`` holds, so that a
    workload survives a JSON round trip unchanged."""
    return msgspec.json.decode(msgspec.json.encode(value))
