"""Reusing a cached tokenization: where it is safe to cut, and why the result is exact.

A cached entry holds a text C and its tokens f(C); the query T shares T[:m] == C[:m].  We pick b, a word
start of C with b <= m - margin, and b', an earlier word start (b' <= b - overlap), tokenize G = T[b':],
and accept only if (a) G's first tokens are exactly C's between b' and b, and (b) G has a word starting
exactly at b with no token straddling it.  Then f(T) = f(C)[tokens before b] + f(G)[tokens from b].

Why this is exact: a Hugging Face pipeline's model encodes each word on its own, the split into words
has bounded right context (the margin covers the look-ahead and the longest added token,
``AddedTokenMargin``) and no long-range left context except at a text's start (which is why G starts at
b', and check (a) confirms the effect died out before b).  The full argument is in
docs/tokenizer-cache.md, "Why a splice is exact".

Invariant: ``reuse_blockers`` admits only pipelines for which the argument holds (else nothing is
cached); if a check fails the text is tokenized in full and counted as a fallback.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import MutableSequence, Sequence
from typing import Any, Protocol

__all__ = [
    "AddedTokenMargin",
    "EncodingLike",
    "Splice",
    "plan_splice",
    "reuse_blockers",
    "sample_seams",
    "start_sensitive",
    "verify_splice",
]


class EncodingLike(Protocol):
    """The parts of ``tokenizers.Encoding`` used here."""

    @property
    def ids(self) -> list[int]: ...

    @property
    def word_ids(self) -> list[int | None]: ...

    def token_to_word(self, token_index: int) -> int | None: ...

    def token_to_chars(self, token_index: int) -> tuple[int, int] | None: ...


def sample_seams(
    enc: EncodingLike,
    n_tokens: int,
    *,
    stride: int,
    first_token: int,
    min_rel_pos: int,
    pos_offset: int,
    idx_offset: int,
    out_pos: MutableSequence[int],
    out_idx: MutableSequence[int],
    tail_tokens: int = 0,
    tail_stride: int = 0,
) -> None:
    """Append word starts of ``enc`` (about one per ``stride`` tokens after ``first_token``, one per
    ``tail_stride`` in the last ``tail_tokens``: where the next request most often leaves this text, a
    question after a shared prefix or the next turn of a chat, dense seams shorten the re-tokenized part).

    A seam is a token index i > 0 whose token starts a word (its word id differs from token i-1's).
    Positions are shifted by ``pos_offset`` and indices by ``idx_offset``; only relative positions >
    ``min_rel_pos`` are kept, in increasing order.  A seam whose position lies inside token i-1 (a
    normalizer that expands one character into two words, as NFKC does with ligatures) is not
    filtered here: ``verify_splice`` rejects it when it is used, at the cost of a fallback.
    """
    words = enc.word_ids  # one call: a per-token lookup crosses the Rust boundary each time
    t2c = enc.token_to_chars
    last = min_rel_pos
    dense_from = n_tokens - tail_tokens if tail_stride > 0 else n_tokens
    i = first_token
    while True:
        step = tail_stride if tail_stride > 0 and i + stride > dense_from else stride
        i += step
        if i >= n_tokens:
            break
        lo = max(i - step + 1, first_token + 1, 1)  # search window (i - step, i]
        j, w = i, words[i]
        while w is not None and words[j - 1] == w:
            j -= 1
            if j < lo:
                w = None  # one word spans the whole window: no seam here
        if w is not None:
            cur = t2c(j)
            if cur is not None and cur[0] > last:
                last = cur[0]
                out_pos.append(cur[0] + pos_offset)
                out_idx.append(j + idx_offset)


# Seams searched, before the overlap point, for one that starts with a space.
_SPACE_SEARCH = 4


class Splice:
    """A chosen seam: reuse ``cached_ids[:idx_b]``, re-tokenize the query from ``pos_b0``."""

    __slots__ = ("idx_b", "idx_b0", "pos_b", "pos_b0", "seam_index")

    def __init__(self, pos_b0: int, idx_b0: int, pos_b: int, idx_b: int, seam_index: int) -> None:
        self.pos_b0 = pos_b0  # b'
        self.idx_b0 = idx_b0
        self.pos_b = pos_b  # b
        self.idx_b = idx_b
        self.seam_index = seam_index  # index of b in the entry's seam arrays


def plan_splice(
    seam_pos: Sequence[int],
    seam_idx: Sequence[int],
    common: int,
    text: str,
    *,
    margin: int,
    overlap: int,
    prefer_space: bool,
) -> Splice | None:
    """Pick b (the last seam <= common - margin) and b' (a seam <= b - overlap), if both exist.

    With ``prefer_space`` (pipelines with a start-of-text scheme), b' prefers a seam where ``text``
    has a space, within a few seams: tokenizing from a space avoids the schemes that prepend one
    (ByteLevel ``add_prefix_space``, Metaspace), which would otherwise change G's first word and fail
    check (a).
    """
    j = bisect_right(seam_pos, common - margin) - 1
    if j < 1:
        return None
    b = seam_pos[j]
    jp = bisect_right(seam_pos, b - overlap, 0, j) - 1
    if jp < 0:
        return None
    for cand in range(jp, max(jp - _SPACE_SEARCH, -1) if prefer_space else jp, -1):
        if text[seam_pos[cand]] == " ":
            jp = cand
            break
    return Splice(seam_pos[jp], seam_idx[jp], b, seam_idx[j], j)


def verify_splice(enc: EncodingLike, ids: list[int], cached_ids: Sequence[int], sp: Splice) -> bool:
    """Checks (a) and (b) of the module docstring on ``enc`` = f(T[b':]) (``ids``: its ids)."""
    n = sp.idx_b - sp.idx_b0
    if ids[:n] != list(cached_ids[sp.idx_b0 : sp.idx_b]):
        return False
    if len(ids) == n:
        return True  # nothing after b produces tokens (e.g. trailing text a normalizer removes)
    beta = sp.pos_b - sp.pos_b0
    cur = enc.token_to_chars(n)
    prev = enc.token_to_chars(n - 1)
    if cur is None or prev is None or cur[0] != beta or prev[1] > beta:
        return False
    w = enc.token_to_word(n)
    return w is not None and w != enc.token_to_word(n - 1)


# -- structural check of the pipeline ----------------------------------------------------------

_OK_NORMALIZERS = {
    "Sequence",
    "NFC",
    "NFD",
    "NFKC",
    "NFKD",
    "Lowercase",
    "StripAccents",
    "Replace",
    "Prepend",
    "BertNormalizer",
    "Precompiled",
    "ByteLevel",
    "Nmt",
}
_OK_PRE_TOKENIZERS = {
    "Sequence",
    "ByteLevel",
    "Split",
    "Metaspace",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
    "Punctuation",
    "Digits",
    "CharDelimiterSplit",
    "UnicodeScripts",
}
_OK_MODELS = {"BPE", "Unigram", "WordPiece", "WordLevel"}


def _regex_blockers(pattern: str) -> list[str]:
    """Constructs that look left of the match start or anchor to the text ends (they break (L))."""
    found: list[str] = []
    i, in_class = 0, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if not in_class and nxt in "bBAzZG":
                found.append("\\" + nxt)
            i += 2
            continue
        if in_class:
            if ch == "[":
                in_class += 1
            elif ch == "]":
                in_class -= 1
        elif ch == "[":
            in_class = 1
            # a ']' right after '[' or '[^' is a literal member
            if pattern[i + 1 : i + 2] == "]":
                i += 1
            elif pattern[i + 1 : i + 3] == "^]":
                i += 2
        elif ch in "^$":
            found.append(ch)
        elif pattern.startswith("(?<=", i) or pattern.startswith("(?<!", i):
            found.append("lookbehind")
        i += 1
    return found


def _walk(node: Any, kind: str, ok: set[str], out: list[str]) -> None:
    if node is None:
        return
    typ = node.get("type")
    if typ not in ok:
        out.append(f"{kind} {typ}")
        return
    for child in node.get("normalizers") or node.get("pretokenizers") or []:
        _walk(child, kind, ok, out)
    if typ == "Split":
        pat = node.get("pattern", {})
        regex = pat.get("Regex")
        if regex is not None:
            out.extend(f"Split regex uses {b}" for b in _regex_blockers(regex))


def reuse_blockers(tokenizer_json: dict[str, Any]) -> list[str]:
    """Why prefix reuse would not be provably exact for this pipeline (empty list: reuse is on)."""
    out: list[str] = []
    model = tokenizer_json.get("model") or {}
    if model.get("type") not in _OK_MODELS:
        out.append(f"model {model.get('type')}")
    if model.get("dropout"):
        out.append("BPE dropout makes tokenization random")
    _walk(tokenizer_json.get("normalizer"), "normalizer", _OK_NORMALIZERS, out)
    _walk(tokenizer_json.get("pre_tokenizer"), "pre_tokenizer", _OK_PRE_TOKENIZERS, out)
    return out


def start_sensitive(tokenizer_json: dict[str, Any]) -> bool:
    """Does the pipeline treat the start of a text specially (prepend a space or a meta-space)?"""
    found: list[bool] = []

    def visit(node: Any) -> None:
        if not isinstance(node, dict):
            return
        typ = node.get("type")
        if typ == "Prepend" or (typ == "ByteLevel" and node.get("add_prefix_space")):
            found.append(True)
        if typ == "Metaspace" and (
            node.get("prepend_scheme", "always") != "never" or node.get("add_prefix_space")
        ):
            found.append(True)
        for child in node.get("normalizers") or node.get("pretokenizers") or []:
            visit(child)

    visit(tokenizer_json.get("normalizer"))
    visit(tokenizer_json.get("pre_tokenizer"))
    return bool(found)


class AddedTokenMargin:
    """The extra margin (R) needs when an added token may start close before the end of the shared text.

    An added token is recognised from its own characters, so a match starting at s is decided by
    text[s : s + L] (L: the longest added token).  Only a match starting in (m - L, b) could see text
    past m; if no added token's first character occurs in text[m - L - 1 : m], none can, and the base
    margin is enough.  Tokens that absorb whitespace on their left (``lstrip``) or match normalized
    text (under a normalizer) start elsewhere than their first character: then the margin always grows.
    """

    __slots__ = ("always", "first_chars", "length")

    def __init__(self, tokenizer_json: dict[str, Any]) -> None:
        tokens = [t for t in tokenizer_json.get("added_tokens") or [] if t.get("content")]
        self.length = max((len(t["content"]) for t in tokens), default=0)
        firsts = sorted({t["content"][0] for t in tokens})
        self.first_chars = re.compile("[" + "".join(re.escape(c) for c in firsts) + "]") if firsts else None
        norm = tokenizer_json.get("normalizer")
        has_normalizer = norm is not None and not (
            norm.get("type") == "Sequence" and not norm.get("normalizers")
        )
        self.always = any(t.get("lstrip") or (t.get("normalized") and has_normalizer) for t in tokens)

    def extra(self, text: str, common: int) -> int:
        if self.first_chars is None:
            return 0
        if self.always or self.first_chars.search(text, max(0, common - self.length - 1), common):
            return self.length
        return 0
