"""Cached texts, their tokens, and a datrie over chunk digests that finds the longest cached prefix.

A text is cut at fixed character positions into chunks of ``chunk_chars``; each chunk maps to a
4-character digest, and the digests of a text's first k chunks form its k-th key (raw text is never put
in the trie).  ``longest_prefix_item`` finds the cached entry sharing the most whole chunks with a query
in one C call; a match is always verified against the texts themselves, so a digest collision costs a
missed reuse, never a wrong token.  Keys name *slots*, and a slot names an entry: when a query extends
a cached text C into T, T takes over C's slot with no trie update beyond T's new keys.

Invariant (I): for every live entry E, each key of E is in the trie and names a slot whose entry's text
starts with the text the key stands for.  ``insert`` and ``evict`` keep it; the argument is in
docs/tokenizer-cache.md, "The prefix index and its invariant".  Entries are immutable once built, so a
caller may keep using one after it has been evicted.  The index serialises its own state with one lock;
no tokenization happens under it.
"""

from __future__ import annotations

import struct
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import overload

import datrie
import numpy as np
import numpy.typing as npt

__all__ = [
    "Entry",
    "Ids",
    "LazySeams",
    "Match",
    "PrefixIndex",
    "SplicedIds",
    "common_prefix_len",
    "head_list",
    "spliced",
]

DIGEST_CHARS = 4
# Map digest byte 0 to 1: the trie alphabet is '\x01'..'\xff' (255 symbols, libdatrie's limit).
_NO_ZERO = bytes([1]) + bytes(range(1, 256))
_MASK32 = 0xFFFFFFFF
# Estimated bytes per cached token id: a list slot plus an int object (even when shared with another
# entry, so the estimate stays an upper bound).
_BYTES_PER_TOKEN = 8 + 32
_ENTRY_OVERHEAD = 400
# Most recently used entries examined when choosing the heir of an evicted entry's keys.
_HEIR_SCAN = 64


U32Array = npt.NDArray[np.uint32]


def ids_array(ids: Sequence[int]) -> U32Array:
    """Token ids as a uint32 array (``array('I')`` converts a list 4x faster than ``np.array``)."""
    return np.frombuffer(array("I", ids), dtype=np.uint32)


class SplicedIds(Sequence[int]):
    """``base[:cut] + tail`` without building it: a query cached after a splice shares its root's tuple
    (siblings after one long system prompt hold one copy of it, and caching a query skips an 8k-id
    copy).  ``base`` is always a plain tuple, so reading an id never walks a chain."""

    __slots__ = ("base", "cut", "tail")

    def __init__(self, base: tuple[int, ...], cut: int, tail: tuple[int, ...]) -> None:
        self.base, self.cut, self.tail = base, cut, tail

    def __len__(self) -> int:
        return self.cut + len(self.tail)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return tuple(self)[i]
            if stop <= self.cut:
                return self.base[start:stop]
            if start >= self.cut:
                return self.tail[start - self.cut : stop - self.cut]
            return self.base[start : self.cut] + self.tail[: stop - self.cut]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.base[i] if i < self.cut else self.tail[i - self.cut]

    def head_list(self, n: int) -> list[int]:
        """``list(self[:n])`` with one copy."""
        out = list(self.base)
        if n <= self.cut:
            del out[n:]
        else:
            del out[self.cut :]
            out += self.tail[: n - self.cut]
        return out

    def then(self, n: int, new_tail: Sequence[int]) -> SplicedIds:
        """``self[:n] + new_tail``, sharing the same root."""
        if n <= self.cut:
            return SplicedIds(self.base, n, tuple(new_tail))
        return SplicedIds(self.base, self.cut, self.tail[: n - self.cut] + tuple(new_tail))


Ids = tuple[int, ...] | SplicedIds


def spliced(ids: Ids, n: int, new_tail: Sequence[int]) -> Ids:
    """``ids[:n] + new_tail``: a ``SplicedIds`` on the root tuple when it uses most of it, else a tuple of
    its own.  An entry pins its whole root, and is charged for it (``Entry``): a short query spliced off
    a long document must not keep the document's ids alive after the document's entry is evicted."""
    root_len = len(ids.base) if isinstance(ids, SplicedIds) else len(ids)
    if 2 * n < root_len:
        return ids[:n] + tuple(new_tail)
    if isinstance(ids, SplicedIds):
        return ids.then(n, new_tail)
    return SplicedIds(ids, n, tuple(new_tail))


def head_list(ids: Ids, n: int) -> list[int]:
    """``list(ids[:n])``, one copy."""
    if isinstance(ids, SplicedIds):
        return ids.head_list(n)
    out = list(ids)
    del out[n:]
    return out


class LazySeams:
    """Reuse-boundary candidates computed when an entry is first spliced from, not when it is cached: most
    cached queries (a question after a shared prompt) are never extended.  A subclass says how
    (``make``); ``count_bound`` bounds how many there will be, ``held_bytes`` what the object keeps
    alive until then (the byte budget counts both).  One object per entry, no closure: every container
    allocated per request brings the next young-generation collection closer."""

    __slots__ = ("count_bound", "held_bytes")

    def __init__(self, count_bound: int, held_bytes: int) -> None:
        self.count_bound, self.held_bytes = count_bound, held_bytes

    def make(self) -> tuple[array[int], array[int]]:
        raise NotImplementedError


Seams = tuple["array[int]", "array[int]"] | LazySeams


class Entry:
    """One cached text and its tokens (without special tokens), plus its reuse-boundary candidates.

    ``seams()`` is ``(seam_pos, seam_idx)``: ``seam_pos[i]`` is a character position in ``text`` that
    starts a word of the tokenization, and ``seam_idx[i]`` the index in ``ids`` of the token that starts
    there.  Both arrays increase.

    NOTE: ``ids`` is a tuple (or a ``SplicedIds`` over one), not a list: the garbage collector stops
    tracking a tuple of ints after one pass, while a list of 8k ints would be traversed by every full
    collection (milliseconds per collection once the cache holds a few hundred entries).
    """

    __slots__ = ("_seams", "arr", "digests", "eid", "ids", "nbytes", "slot", "text")

    def __init__(
        self,
        eid: int,
        text: str,
        ids: Ids,
        seams: Seams,
        digests: str,
        arr: U32Array | None = None,
    ) -> None:
        self.eid = eid
        self.text = text
        self.ids = ids
        # The same ids as uint32, for callers that hash them (the router): an array is built from its
        # cached prefix's array at once, where a list of Python ints is converted int by int.
        self.arr = ids_array(ids) if arr is None else arr
        self._seams = seams
        self.digests = digests
        self.slot = 0
        if isinstance(seams, LazySeams):
            seam_bytes = 8 * seams.count_bound + seams.held_bytes
        else:
            seam_bytes = seams[0].itemsize * (len(seams[0]) + len(seams[1]))
        self.nbytes = (
            sys.getsizeof(text)
            + 64
            # counted whole even when shared with a sibling: a SplicedIds for its whole root (it keeps all
            # of it alive), so the estimate stays a bound
            + (_BYTES_PER_TOKEN + 4)
            * (len(ids.base) + len(ids.tail) if isinstance(ids, SplicedIds) else len(ids))
            + seam_bytes
            + 128
            + sys.getsizeof(digests)
            # trie cells: one per new digest character at most, plus key tails
            + 16 * len(digests)
            + _ENTRY_OVERHEAD
        )

    def seams(self) -> tuple[array[int], array[int]]:
        """``(seam_pos, seam_idx)``, computed on first use.  Two threads may both compute them: the
        result is the same, and the attribute is swapped in one step."""
        s = self._seams
        if isinstance(s, LazySeams):
            s = s.make()
            self._seams = s
        return s


class Match:
    """A lookup result: ``entry.text[:common] == query[:common]`` and ``common`` is maximal."""

    __slots__ = ("common", "entry", "shared_chunks")

    def __init__(self, entry: Entry, common: int, shared_chunks: int) -> None:
        self.entry = entry
        self.common = common
        self.shared_chunks = shared_chunks


def common_prefix_len(a: str, b: str, start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that they agree on ``[0, start)``."""
    n = min(len(a), len(b))
    if a[start:n] == b[start:n]:
        return n
    lo, hi = start, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


class PrefixIndex:
    """LRU-bounded map from cached texts to entries, searchable by longest chunk-aligned prefix."""

    def __init__(self, *, chunk_chars: int, max_bytes: int) -> None:
        self.chunk_chars = chunk_chars
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._trie = datrie.BaseTrie(ranges=[("\x01", "\xff")])
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # LRU order: oldest first
        self._slots: dict[int, int] = {}  # slot -> eid of the live entry it names
        self._extra_keys: dict[int, list[str]] = {}  # slot -> terminal keys of superseded entries
        # slot -> k such that the slot names none of its entry's keys shorter than key k (its first k
        # digests); eviction only looks at keys k and longer
        self._slot_low: dict[int, int] = {}
        self._next_eid = 1
        self.bytes_held = 0
        self.evictions = 0

    # -- digests (pure, no lock) ------------------------------------------------------------------

    def chunk_digests(self, text: str) -> str:
        """Digest string of the whole chunks of ``text`` (``DIGEST_CHARS`` characters per chunk)."""
        c = self.chunk_chars
        k = len(text) // c
        if k == 0:
            return ""
        hs = [hash(text[i : i + c]) & _MASK32 for i in range(0, k * c, c)]
        return struct.pack(f"<{k}I", *hs).translate(_NO_ZERO).decode("latin-1")

    def entry_digests(self, text: str, chunk_digests: str) -> str:
        """All digests of a text to cache: its whole chunks, then its tail (if any) as terminal."""
        tail = text[len(chunk_digests) // DIGEST_CHARS * self.chunk_chars :]
        if not tail:
            return chunk_digests
        # A different function than the chunk digest, so a tail rarely equals a whole chunk's digest.
        h = hash(("tail", tail)) & _MASK32
        return chunk_digests + struct.pack("<I", h).translate(_NO_ZERO).decode("latin-1")

    # -- queries --------------------------------------------------------------------------------

    def lookup(self, text: str, digests: str) -> Match | None:
        """The cached entry sharing the longest prefix with ``text`` (``digests`` from chunk_digests)."""
        if not digests:
            return None
        with self._lock:
            item = self._trie.longest_prefix_item(digests, None)
            if item is None:
                return None
            key, slot = item
            entry = self._entries[self._slots[slot]]
            self._entries.move_to_end(entry.eid)
        shared = len(key) // DIGEST_CHARS
        c = self.chunk_chars
        verified = shared * c
        if not text.startswith(entry.text[:verified]):
            # digest collision: find the true common prefix from scratch
            return Match(entry, common_prefix_len(text, entry.text), shared)
        # The entry cannot share chunk shared+1 whole (its key for it would have matched), so the common
        # prefix ends within one chunk; the loop only continues after a collision.
        common = verified
        while True:
            a, b = text[common : common + c], entry.text[common : common + c]
            n = common_prefix_len(a, b)
            common += n
            if n < c or not a:
                return Match(entry, common, shared)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        """The live entries, least recently used first (a copy)."""
        with self._lock:
            return list(self._entries.values())

    # -- updates --------------------------------------------------------------------------------

    def insert(
        self,
        text: str,
        ids: Ids,
        seams: Seams,
        digests: str,
        *,
        known_keys: int = 0,
        supersedes: Entry | None = None,
        arr: U32Array | None = None,
    ) -> Entry | None:
        """Cache ``text``; ``supersedes`` is an entry whose text prefixes this one (it is dropped).

        ``known_keys``: how many leading keys of ``digests`` the lookup found in the trie already.
        Returns the new entry; the live entry that already covers ``text`` (whose text starts with it:
        a concurrent duplicate, or a longer text), which is then not duplicated; or None when the entry
        alone would exceed the byte budget.
        """
        with self._lock:
            slot = self._trie.get(digests) if digests else None
            if slot is not None:
                owner = self._entries[self._slots[slot]]
                if owner.text.startswith(text):  # (I) needs this: see "evict" in the module docstring
                    self._entries.move_to_end(owner.eid)
                    return owner
            entry = Entry(self._next_eid, text, ids, seams, digests, arr)
            if entry.nbytes > self.max_bytes:
                return None
            self._next_eid += 1
            old = supersedes if supersedes is not None and supersedes.eid in self._entries else None
            if old is not None:
                entry.slot = old.slot  # every key leading to the old text now leads to the new one
                del self._entries[old.eid]
                self.bytes_held -= old.nbytes
                if len(old.text) % self.chunk_chars:  # its terminal key still names this slot
                    self._extra_keys.setdefault(old.slot, []).append(old.digests)
            else:
                entry.slot = entry.eid
            self._slots[entry.slot] = entry.eid
            # Keys known_keys+1.. are set when absent; once one is absent all longer ones are (a longer
            # key's owner would hold the shorter one, by (I)), so the slot owns a suffix of the keys.
            trie, slot, d = self._trie, entry.slot, DIGEST_CHARS
            low = len(digests) // d + 1
            for k in range(max(known_keys, 0) + 1, len(digests) // d + 1):
                if trie.setdefault(digests[: k * d], slot) == slot:
                    low = k
                    break
            for k in range(low + 1, len(digests) // d + 1):
                trie[digests[: k * d]] = slot
            self._slot_low[slot] = min(low, self._slot_low.get(slot, low))
            self._entries[entry.eid] = entry
            self.bytes_held += entry.nbytes
            while self.bytes_held > self.max_bytes and self._entries:
                _, oldest = next(iter(self._entries.items()))
                self._remove(oldest)
                self.evictions += 1
            return entry

    def clear(self) -> None:
        with self._lock:
            self._trie = datrie.BaseTrie(ranges=[("\x01", "\xff")])
            self._entries.clear()
            self._slots.clear()
            self._extra_keys.clear()
            self._slot_low.clear()
            self.bytes_held = 0

    def _remove(self, entry: Entry) -> None:
        """Drop ``entry`` and the keys only its slot needs, keeping invariant (I).  Lock held."""
        trie, slot, d = self._trie, entry.slot, DIGEST_CHARS
        for key in self._extra_keys.pop(slot, ()):  # superseded terminals: deepest in their branch
            if trie.get(key) == slot:
                self._release(key, slot)
        low = self._slot_low.pop(slot)
        heir: int | None = None
        for k in range(len(entry.digests) // d, low - 1, -1):
            key = entry.digests[: k * d]
            if trie.get(key) != slot:
                continue  # held by an older entry (an heir's range can straddle another's keys)
            if heir is None:
                heir = self._release(key, slot)
                if heir is not None:
                    self._slot_low[heir] = min(low, self._slot_low[heir])
            else:
                trie[key] = heir  # a longer key of E has a live descendant: so does this one
        del self._entries[entry.eid]
        del self._slots[slot]
        self.bytes_held -= entry.nbytes

    def _release(self, key: str, slot: int) -> int | None:
        """Re-point ``key`` (named by ``slot``) to a live slot below it, or delete it; return the heir.

        The heir is preferably the most recently used entry holding the key, so that it is evicted
        last and the keys do not move again soon.
        """
        state = datrie.BaseState(self._trie)
        heir: int | None = None
        if state.walk(key) and not state.is_leaf():
            for n, e in enumerate(reversed(self._entries.values())):
                if e.slot != slot and e.digests.startswith(key):
                    heir = e.slot
                    break
                if n >= _HEIR_SCAN:
                    break
            if heir is None:
                it = datrie.BaseIterator(state)
                while it.next():
                    if it.key() and it.data() != slot:
                        heir = int(it.data())
                        break
        if heir is None:
            del self._trie[key]
        else:
            self._trie[key] = heir
        return heir

    # -- checking -------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert invariant (I) and the byte accounting (for tests; O(total key length))."""
        with self._lock:
            d = DIGEST_CHARS
            for entry in self._entries.values():
                assert self._slots[entry.slot] == entry.eid
                for k in range(d, len(entry.digests) + 1, d):
                    key = entry.digests[:k]
                    slot = self._trie.get(key)
                    assert slot in self._slots, (key, slot)
                    owner = self._entries[self._slots[slot]]
                    terminal = k == len(entry.digests) and len(entry.text) % self.chunk_chars
                    if terminal:
                        assert owner.text.startswith(entry.text) or owner.digests.startswith(key)
                    else:
                        span = k // d * self.chunk_chars
                        assert owner.text[:span] == entry.text[:span], "key leads to a different text"
                low = self._slot_low[entry.slot]
                for k in range(1, min(low, len(entry.digests) // d + 1)):
                    assert self._trie.get(entry.digests[: k * d]) != entry.slot, "a key below the slot's low"
            assert self.bytes_held == sum(e.nbytes for e in self._entries.values())
            assert self.bytes_held <= self.max_bytes
            for _, slot in self._trie.items():
                assert slot in self._slots, "a trie key names a dead slot"
