"""The wire's fast path: the shapes a healthy fleet sends all day, parsed in one compiled pass.

``wire.BatchDecoder`` (msgspec) is the reference decoder: every release's shape, bad events isolated and
counted.  This module reads only the common shapes and declines everything else::

    [float64 ts, [event, ...]]  or  [float64 ts, [event, ...], rank | nil]
    event = BlockStored | BlockRemoved, positional (<= 0.23) or map (>= 0.24), shapes mixed freely
      ──parse──▶  rows[i] = [kind, medium, n, first engine, has parent, parent, first block, 0]
                  engines: the events' engine hashes back to back (64 bits, as ``wire.engine_hash_i64``)
                  blocks:  the content hash of each stored block's tokens (``hashing``'s block hash)

Accepted (the caller may apply the rows instead of the reference decoder's events) only when the
reference decoder would decode the payload to exactly these events with nothing skipped, and
``EventApplier._stored`` / ``_removed`` would take their plain path:

* stored: ``block_size`` an int, the index's unless the event is an offload placeholder; ``token_ids``
  msgpack uints below 2**32 covering exactly the blocks, or the offload placeholder ``[]``; ``lora_name``
  nil; ``extra_keys`` nil or only nils; ``group_idx`` nil or 0; ``medium`` nil, "GPU", "CPU" or
  "STORAGE"; ``lora_id`` an int or nil; ``kv_cache_spec_kind`` an ASCII str or nil;
  ``kv_cache_spec_sliding_window`` an int or nil;
* removed: ``medium`` and ``group_idx`` as above;
* every other key or trailing element nil; no key twice; strings ASCII; hashes ints or bytes.

Anything else (an AllBlocksCleared, a LoRA, a salt, another KV group, a field some later code reads) is
declined and the caller takes the reference path for the whole payload, so what the index ends up
holding never depends on which path ran (``tests/indexer/test_fast_ingest.py`` checks exactly that).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from .hashing import _parse_blocks

STORED = 1
REMOVED = 2
LINK = 3  # a stored event with the offload placeholder: engine hashes of blocks already known
NOOP = 4  # a stored event with no blocks
ROW = 8  # columns of a row: kind, medium, n, engine offset, has parent, parent, block offset, spare

DECLINED = 0
ACCEPTED = 1
GROW = -1  # the scratch arrays are too small for this payload

# field ids, in positional order of BlockStored; removed events map their positions onto these
(_TYPE, _HASHES, _PARENT, _TOKENS, _BS, _LORA_ID, _MEDIUM, _LORA_NAME, _EXTRA, _GROUP, _KIND, _WINDOW,
 _OTHER) = range(13)  # fmt: skip
_NAMES = (
    b"type", b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size", b"lora_id", b"medium",
    b"lora_name", b"extra_keys", b"group_idx", b"kv_cache_spec_kind", b"kv_cache_spec_sliding_window",
)  # fmt: skip
_REMOVED_POS = np.array([_TYPE, _HASHES, _MEDIUM, _GROUP], dtype=np.int64)


def _table(words: tuple[bytes, ...]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(w) for w in words)
    t = np.zeros((len(words), width), dtype=np.uint8)
    for i, w in enumerate(words):
        t[i, : len(w)] = np.frombuffer(w, dtype=np.uint8)
    lens = np.array([len(w) for w in words], dtype=np.int64)
    t.setflags(write=False)
    lens.setflags(write=False)
    return t, lens


_KEYS, _KEY_LENS = _table(_NAMES)
_TAGS, _TAG_LENS = _table((b"BlockStored", b"BlockRemoved"))
_MEDIA, _MEDIA_LENS = _table((b"GPU", b"CPU", b"STORAGE"))


@njit(inline="always")
def _be(buf: Any, pos: Any, k: Any) -> Any:
    """``k`` bytes at ``pos``, big-endian, as a uint64."""
    v = np.uint64(0)
    for j in range(k):
        v = (v << np.uint64(8)) | np.uint64(buf[pos + j])
    return v


@njit(inline="always")
def _int(buf: Any, pos: Any, n: Any) -> tuple[Any, Any, Any]:
    """(1 if a msgpack int is at ``pos`` (2 if a uint64 >= 2**63), its 64 bits as an int64, next)."""
    c = buf[pos]
    if c < 0x80:
        return 1, np.int64(c), pos + 1
    if c >= 0xE0:
        return 1, np.int64(c) - 256, pos + 1
    if 0xCC <= c <= 0xD3:
        k = 1 << ((c - 0xCC) & 3)
        if pos + k >= n:
            return 0, np.int64(0), pos
        v = _be(buf, pos + 1, k)
        if c >= 0xD0 and k < 8 and v >> np.uint64(8 * k - 1):  # a negative intN: sign-extend
            v |= ~((np.uint64(1) << np.uint64(8 * k)) - np.uint64(1))
        big = 2 if c == 0xCF and v >> np.uint64(63) else 1
        return big, np.int64(v), pos + 1 + k
    return 0, np.int64(0), pos


@njit(inline="always")
def _hash(buf: Any, pos: Any, n: Any) -> tuple[Any, Any, Any]:
    """(ok, 64 bits, next) of an engine hash: an int, or bytes (their last 8, big-endian)."""
    kind, v, nxt = _int(buf, pos, n)
    if kind:
        return True, v, nxt
    c = buf[pos]
    if 0xC4 <= c <= 0xC6:
        k = 1 << (c - 0xC4)
        if pos + k >= n:
            return False, np.int64(0), pos
        ln = np.int64(_be(buf, pos + 1, k))
        start = pos + 1 + k
        if start + ln > n:
            return False, np.int64(0), pos
        tail = min(ln, 8)
        return True, np.int64(_be(buf, start + ln - tail, tail)), start + ln
    return False, np.int64(0), pos


@njit(inline="always")
def _str(buf: Any, pos: Any, n: Any) -> tuple[Any, Any, Any]:
    """(start, length, next) of an ASCII msgpack str at ``pos``; start -1 if it is not one."""
    c = buf[pos]
    if 0xA0 <= c <= 0xBF:
        ln = np.int64(c & 0x1F)
        start = pos + 1
    elif 0xD9 <= c <= 0xDB:
        k = 1 << (c - 0xD9)
        if pos + k >= n:
            return -1, 0, pos
        ln = np.int64(_be(buf, pos + 1, k))
        start = pos + 1 + k
    else:
        return -1, 0, pos
    if start + ln > n:
        return -1, 0, pos
    for j in range(start, start + ln):
        if buf[j] >= 0x80:
            return -1, 0, pos
    return start, ln, start + ln


@njit(inline="always")
def _container(buf: Any, pos: Any, n: Any, fix: Any, b16: Any) -> tuple[Any, Any]:
    """(count, next) of an array (``fix`` 0x90, ``b16`` 0xDC) or map (0x80, 0xDE) header; -1 if not one."""
    c = buf[pos]
    if fix <= c <= fix + 15:
        return np.int64(c & 0x0F), pos + 1
    if c == b16 or c == b16 + 1:
        k = 2 if c == b16 else 4
        if pos + k >= n:
            return -1, pos
        return np.int64(_be(buf, pos + 1, k)), pos + 1 + k
    return -1, pos


@njit(inline="always")
def _which(buf: Any, start: Any, ln: Any, table: Any, lens: Any) -> Any:
    """Index of the word ``buf[start : start + ln]`` in ``table``, -1 if absent."""
    for w in range(len(lens)):
        if lens[w] != ln:
            continue
        same = True
        for j in range(ln):
            if buf[start + j] != table[w, j]:
                same = False
                break
        if same:
            return w
    return -1


@njit(cache=True, nogil=True)
def parse_batch(
    buf: Any, block_size: Any, rows: Any, engines: Any, blocks: Any
) -> tuple[Any, Any, Any, Any, Any]:
    """Parse a payload into ``rows`` / ``engines`` / ``blocks``.  Returns (ACCEPTED, DECLINED or GROW;
    events; ts; rank, -1 when the batch carries none; blocks written)."""
    n = len(buf)
    if n < 11 or (buf[0] != 0x92 and buf[0] != 0x93) or buf[1] != 0xCB:
        return DECLINED, 0, 0.0, -1, 0
    ts = np.array([_be(buf, 2, 8)], dtype=np.uint64).view(np.float64)[0]
    n_ev, pos = _container(buf, 10, n, 0x90, 0xDC)
    if n_ev < 0 or n_ev > n - pos:  # (every count is checked against the bytes left: a bad header
        # never asks for more room)
        return DECLINED, 0, 0.0, -1, 0
    if n_ev > len(rows):
        return GROW, 0, 0.0, -1, 0
    ne = 0  # engines written
    nb = 0  # blocks written
    for i in range(n_ev):
        if pos >= n:
            return DECLINED, 0, 0.0, -1, 0
        is_map = False
        cnt, pos = _container(buf, pos, n, 0x90, 0xDC)
        if cnt < 0:
            cnt, pos = _container(buf, pos, n, 0x80, 0xDE)
            if cnt < 0:
                return DECLINED, 0, 0.0, -1, 0
            is_map = True
        tag = 0
        seen = 0
        n_blocks = -1
        e_off = ne
        has_parent = 0
        parent = np.int64(0)
        tokens = -1  # -1 absent, -2 nil, else the token count (0: the placeholder)
        medium = 0
        for k in range(cnt):
            if pos >= n:
                return DECLINED, 0, 0.0, -1, 0
            if is_map:
                ks, kl, pos = _str(buf, pos, n)
                if ks < 0:
                    return DECLINED, 0, 0.0, -1, 0
                fid = _which(buf, ks, kl, _KEYS, _KEY_LENS)
                if fid < 0:
                    fid = _OTHER
                elif seen & (1 << fid):
                    return DECLINED, 0, 0.0, -1, 0
                else:
                    seen |= 1 << fid
                if pos >= n:
                    return DECLINED, 0, 0.0, -1, 0
            elif k == 0:
                fid = _TYPE
            elif tag == REMOVED:
                fid = _REMOVED_POS[k] if k < 4 else _OTHER
            else:
                fid = k if k < _OTHER else _OTHER
            c = buf[pos]
            if fid == _TYPE:
                ts_, tl, pos = _str(buf, pos, n)
                w = _which(buf, ts_, tl, _TAGS, _TAG_LENS) if ts_ >= 0 else -1
                if w < 0:
                    return DECLINED, 0, 0.0, -1, 0
                tag = STORED if w == 0 else REMOVED
            elif c == 0xC0 and fid != _HASHES:  # nil: the default of every optional field
                if fid == _BS:  # an int the reference decoder requires
                    return DECLINED, 0, 0.0, -1, 0
                if fid == _TOKENS:
                    tokens = -2  # kept raw by the reference decoder: not the placeholder
                pos += 1
            elif fid == _HASHES:
                n_blocks, pos = _container(buf, pos, n, 0x90, 0xDC)
                if n_blocks < 0 or n_blocks > n - pos:
                    return DECLINED, 0, 0.0, -1, 0
                if ne + n_blocks > len(engines):
                    return GROW, 0, 0.0, -1, 0
                e_off = ne
                for _ in range(n_blocks):
                    if pos >= n:
                        return DECLINED, 0, 0.0, -1, 0
                    ok, h, pos = _hash(buf, pos, n)
                    if not ok:
                        return DECLINED, 0, 0.0, -1, 0
                    engines[ne] = h
                    ne += 1
            elif fid == _PARENT:
                ok, parent, pos = _hash(buf, pos, n)
                if not ok:
                    return DECLINED, 0, 0.0, -1, 0
                has_parent = 1
            elif fid == _TOKENS:
                cnt_t, p2 = _container(buf, pos, n, 0x90, 0xDC)
                if cnt_t < 0 or cnt_t % block_size or cnt_t > n - p2:
                    return DECLINED, 0, 0.0, -1, 0
                if cnt_t == 0 and buf[pos] != 0x90:  # only the one-byte [] is the placeholder
                    return DECLINED, 0, 0.0, -1, 0
                m = cnt_t // block_size
                if nb + m > len(blocks):
                    return GROW, 0, 0.0, -1, 0
                got, end = _parse_blocks(buf, p2, block_size, m, blocks[nb:])
                if got != m:
                    return DECLINED, 0, 0.0, -1, 0
                pos = end
                tokens = cnt_t
            elif fid in (_BS, _LORA_ID, _GROUP, _WINDOW):
                kind, v, pos = _int(buf, pos, n)
                if kind == 0:
                    return DECLINED, 0, 0.0, -1, 0
                if (fid == _BS and kind != 1) or (fid == _GROUP and v != 0):
                    return DECLINED, 0, 0.0, -1, 0
                if fid == _BS and v == block_size:  # (any size for a placeholder: vLLM 0.33 sends 0)
                    seen |= 1 << 20
            elif fid == _MEDIUM:
                ms, ml, pos = _str(buf, pos, n)
                medium = _which(buf, ms, ml, _MEDIA, _MEDIA_LENS) if ms >= 0 else -1
                if medium < 0:
                    return DECLINED, 0, 0.0, -1, 0
            elif fid == _KIND:
                ks2, _kl, pos = _str(buf, pos, n)
                if ks2 < 0:
                    return DECLINED, 0, 0.0, -1, 0
            elif fid == _EXTRA:
                cnt_x, pos = _container(buf, pos, n, 0x90, 0xDC)
                if cnt_x < 0 or pos + cnt_x > n:
                    return DECLINED, 0, 0.0, -1, 0
                for j in range(cnt_x):
                    if buf[pos + j] != 0xC0:
                        return DECLINED, 0, 0.0, -1, 0
                pos += cnt_x
            else:  # lora_name, or a key the reference path does not read: only nil (handled above)
                return DECLINED, 0, 0.0, -1, 0
        if tag == 0 or n_blocks < 0:
            return DECLINED, 0, 0.0, -1, 0
        r = rows[i]
        r[1] = medium
        r[2] = n_blocks
        r[3] = e_off
        r[4] = has_parent
        r[5] = parent
        r[6] = nb
        r[7] = 0
        if tag == REMOVED:
            r[0] = REMOVED
        elif n_blocks == 0:
            r[0] = NOOP
        elif tokens == -2:
            return DECLINED, 0, 0.0, -1, 0
        elif tokens <= 0:  # the placeholder (also what an absent token_ids means)
            if nb + n_blocks > len(blocks):
                return GROW, 0, 0.0, -1, 0
            r[0] = LINK
            nb += n_blocks  # room for the chains the link resolves
        else:
            if tokens != n_blocks * block_size or not seen & (1 << 20):
                return DECLINED, 0, 0.0, -1, 0
            r[0] = STORED
            nb += n_blocks
    if pos != n and buf[0] == 0x92:
        return DECLINED, 0, 0.0, -1, 0
    rank = -1
    if buf[0] == 0x93:
        if pos >= n:
            return DECLINED, 0, 0.0, -1, 0
        if buf[pos] == 0xC0:
            pos += 1
        else:
            kind, v, pos = _int(buf, pos, n)
            if kind != 1 or v < 0 or v > 0xFFFF:
                return DECLINED, 0, 0.0, -1, 0
            rank = v
        if pos != n:
            return DECLINED, 0, 0.0, -1, 0
    return ACCEPTED, n_ev, ts, rank, nb
