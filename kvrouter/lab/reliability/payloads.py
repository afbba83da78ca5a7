"""Hostile and valid-looking KV-event payloads for fuzzing the decoder and the index (seeded, pure).

``HostilePayloads(rng).next()`` gives a ``Sample(family, payload, expect)`` of one family: ``valid``
(well-formed batches of every release shape, chained on blocks stored before), ``structural`` (bad
parents, duplicate hashes, absurd block sizes, token counts that do not cover the blocks, empty offload
placeholders), ``typing`` (wrong field types, bad mediums, huge or negative ints, odd-length bytes
hashes) or ``bytes`` (truncated msgpack, flipped bytes, garbage, lying array headers, deep nesting).

``expect`` names the rejection reasons a sample must be counted under (empty: any accounting will do);
the fuzz run checks it.  The generator keeps a small model of the engine hashes it has stored, so
children and removals hit known blocks, and the control source's hashes, so cross-source references hit
real blocks of another source.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any

import msgspec

from indexer.encode import RELEASES, PayloadEncoder

_ENC = msgspec.msgpack.Encoder()
_U64 = (1 << 64) - 1
_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_WEIRD: tuple[Any, ...] = (
    *(None, True, -1, -(1 << 63), _U64, 2.5, float("nan"), "str", b"\x00" * 9),
    *([], [[1]], {"a": 1}, {1: [2]}),
)
_STORED_NAMES = (
    *("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    *("lora_name", "extra_keys", "group_idx"),
)


class Sample(msgspec.Struct, frozen=True):
    family: str
    payload: bytes
    expect: frozenset[str] = frozenset()
    """Reasons at least one of which must be counted (decode, event or skip reasons)."""


class HostilePayloads:
    """An endless, seeded stream of payloads aimed at one source (``dp_rank`` small, sometimes not)."""

    def __init__(self, rng: random.Random, block_size: int = 16, *, huge_every: int = 4000) -> None:
        self.rng = rng
        self.bs = block_size
        self.huge_every = huge_every
        """One payload in this many is a huge one (hundreds of thousands of hashes: slow, rare)."""
        self._encoders = {r: PayloadEncoder(r) for r in RELEASES}
        self._known: list[int] = []  # engine hashes this generator stored (most recent last)
        self.foreign: list[int] = []
        """Engine hashes of another source (the control): parents and removals aimed at them."""
        self._n = 0
        families: list[tuple[str, int, Callable[[], Sample]]] = [
            ("valid_stored", 20, self._valid_stored),
            ("valid_removed", 8, self._valid_removed),
            ("valid_cleared", 1, self._valid_cleared),
            ("unknown_parent", 4, self._unknown_parent),
            ("self_parent", 3, self._self_parent),
            ("cross_source", 3, self._cross_source),
            ("duplicate_hashes", 3, self._duplicate_hashes),
            ("absurd_block_size", 3, self._absurd_block_size),
            ("short_tokens", 3, self._short_tokens),
            ("bad_tokens", 3, self._bad_tokens),
            ("wrong_types", 6, self._wrong_types),
            ("bad_medium", 2, self._bad_medium),
            ("other_group", 1, self._other_group),
            ("offload_unknown", 2, self._offload_unknown),
            ("bytes_hashes", 3, self._bytes_hashes),
            ("unknown_tag", 2, self._unknown_tag),
            ("extra_fields", 2, self._extra_fields),
            ("map_batch", 2, self._map_batch),
            ("bad_batch", 4, self._bad_batch),
            ("empty_batch", 1, self._empty_batch),
            ("truncated", 8, self._truncated),
            ("bitflip", 8, self._bitflip),
            ("garbage", 4, self._garbage),
            ("claimed_huge", 2, self._claimed_huge),
            ("deep_nesting", 1, self._deep_nesting),
        ]
        self._families = [f for _, _, f in families]
        self._weights = [w for _, w, _ in families]

    # ------------------------------------------------------------------ driving
    def next(self) -> Sample:
        self._n += 1
        if self.huge_every and self._n % self.huge_every == 0:
            return self._huge()
        (gen,) = self.rng.choices(self._families, self._weights)
        return gen()

    # ------------------------------------------------------------------ helpers
    def _enc(self) -> PayloadEncoder:
        return self._encoders[self.rng.choice(RELEASES)]

    def _rank(self) -> int:
        # Mostly rank 0, a few others; a rank becomes a source of its own.
        return 0 if self.rng.random() < 0.9 else self.rng.randrange(4)

    def _hash(self) -> int:
        return self.rng.getrandbits(64)

    def _tokens(self, blocks: int) -> list[int]:
        r = self.rng
        return [r.randrange(1, 1 << 17) for _ in range(blocks * self.bs)]

    def _batch(self, events: list[Any], *, enc: PayloadEncoder | None = None) -> bytes:
        enc = enc or self._enc()
        return enc.batch(events, ts=1.7e9 + self._n * 0.001, dp_rank=self._rank())

    def _stored(
        self,
        enc: PayloadEncoder,
        hashes: list[int],
        parent: int | None,
        tokens: list[int],
        block_size: int | None = None,
        **kw: Any,
    ) -> msgspec.Struct:
        return enc.stored(hashes, parent, tokens, self.bs if block_size is None else block_size, **kw)

    def _remember(self, hashes: list[int]) -> None:
        self._known.extend(hashes)
        if len(self._known) > 4096:
            del self._known[:1024]

    def _valid_bytes(self) -> bytes:
        return self._valid_stored().payload

    # ------------------------------------------------------------------ valid
    def _valid_stored(self) -> Sample:
        enc = self._enc()
        n = self.rng.randint(1, 6)
        hashes = [self._hash() for _ in range(n)]
        parent = self.rng.choice(self._known) if self._known and self.rng.random() < 0.5 else None
        salt = [[f"salt-{self.rng.randrange(3)}"]] + [None] * (n - 1) if self.rng.random() < 0.3 else None
        ev = self._stored(enc, hashes, parent, self._tokens(n), extra_keys=salt if parent is None else None)
        self._remember(hashes)
        return Sample("valid_stored", self._batch([ev], enc=enc))

    def _valid_removed(self) -> Sample:
        enc = self._enc()
        pool = self._known or [self._hash()]
        evs = [enc.removed([self.rng.choice(pool)]) for _ in range(self.rng.randint(1, 8))]
        return Sample("valid_removed", self._batch(evs, enc=enc))

    def _valid_cleared(self) -> Sample:
        enc = self._enc()
        return Sample("valid_cleared", self._batch([enc.cleared()], enc=enc))

    # ------------------------------------------------------------------ structural
    def _unknown_parent(self) -> Sample:
        enc = self._enc()
        ev = self._stored(enc, [self._hash()], self._hash(), self._tokens(1))
        return Sample("unknown_parent", self._batch([ev], enc=enc), frozenset({"unknown_parent"}))

    def _self_parent(self) -> Sample:
        enc = self._enc()
        if self._known and self.rng.random() < 0.5:
            h = self.rng.choice(self._known)  # a known block re-stored as its own child: applied, harmless
            ev = self._stored(enc, [h], h, self._tokens(1))
            return Sample("self_parent", self._batch([ev], enc=enc))
        h = self._hash()
        ev = self._stored(enc, [h], h, self._tokens(1))
        return Sample("self_parent", self._batch([ev], enc=enc), frozenset({"unknown_parent"}))

    def _cross_source(self) -> Sample:
        enc = self._enc()
        if not self.foreign:
            return self._unknown_parent()
        h = self.rng.choice(self.foreign)
        if self.rng.random() < 0.5:
            # The control's block as a parent: unknown to this source (engine hashes are per source).
            ev = self._stored(enc, [self._hash()], h, self._tokens(1))
            return Sample("cross_source", self._batch([ev], enc=enc), frozenset({"unknown_parent"}))
        # Removing the control's block from this source: unknown here, the control keeps it.
        ev = enc.removed([h])
        return Sample("cross_source", self._batch([ev], enc=enc), frozenset({"unknown_removed_block"}))

    def _duplicate_hashes(self) -> Sample:
        enc = self._enc()
        h = self._hash()
        n = self.rng.randint(2, 5)
        evs: list[Any] = [self._stored(enc, [h] * n, None, self._tokens(n))]
        if self.rng.random() < 0.5:
            evs.append(enc.removed([h]))
            evs.append(enc.removed([h]))
        self._remember([h])
        return Sample("duplicate_hashes", self._batch(evs, enc=enc))

    def _absurd_block_size(self) -> Sample:
        enc = self._enc()
        bs = self.rng.choice((-1, 1, 3, 15, 17, 64, 4096, 1 << 31, (1 << 63) - 1, 1 << 63, _U64))
        ev = self._stored(enc, [self._hash()], None, self._tokens(1), block_size=bs)
        # Ints beyond int64 fail typed decoding (a skipped event); the rest disagree with the fleet.
        return Sample(
            "absurd_block_size",
            self._batch([ev], enc=enc),
            frozenset({"block_size_mismatch", "bad_event", "bad_block_shape"}),
        )

    def _short_tokens(self) -> Sample:
        enc = self._enc()
        n = self.rng.randint(1, 4)
        tokens = self._tokens(n)
        # Keep at least one token: an empty list is an offload placeholder, a different (valid) event.
        cut = min(self.rng.choice((1, self.bs, len(tokens) - 1)), len(tokens) - 1)
        tail = [7] * self.rng.randint(1, 40) if self.rng.random() < 0.3 else []
        tokens = tokens[: len(tokens) - cut] + tail
        if len(tokens) % self.bs == 0 and len(tokens) >= n * self.bs:
            tokens.append(1)
        ev = self._stored(enc, [self._hash() for _ in range(n)], None, tokens)
        return Sample("short_tokens", self._batch([ev], enc=enc), frozenset({"bad_block_shape"}))

    def _bad_tokens(self) -> Sample:
        enc = self._enc()
        tokens: list[Any] = self._tokens(1)
        i = self.rng.randrange(len(tokens))
        tokens[i] = self.rng.choice((-1, 1 << 32, _U64, -(1 << 63), 1.5, "x", None, [1], True))
        ev = self._stored(enc, [self._hash()], None, tokens)
        return Sample(
            "bad_tokens", self._batch([ev], enc=enc), frozenset({"bad_block_shape", "bad_field", "bad_event"})
        )

    def _wrong_types(self) -> Sample:
        """A valid-looking event with one field replaced by a value of another type."""
        r = self.rng
        weird = r.choice(_WEIRD)
        tag = r.choice(_TAGS[:2])
        if tag == "BlockStored":
            fields: list[Any] = [[self._hash()], None, self._tokens(1), self.bs, None, "GPU", None, None, 0]
        else:
            fields = [[self._hash()], "GPU", None]
        fields[r.randrange(len(fields))] = weird
        if r.random() < 0.5:
            ev: Any = [tag, *fields]
        else:
            names = _STORED_NAMES if tag == "BlockStored" else ("block_hashes", "medium", "group_idx")
            ev = {"type": tag, **dict(zip(names, fields))}
        return Sample("wrong_types", _ENC.encode([1.7e9, [ev], 0]))

    def _bad_medium(self) -> Sample:
        enc = self._enc()
        medium = self.rng.choice(("GPU2", "", "disk", "gpu", "Cpu", "STORAGE "))
        if self.rng.random() < 0.5:
            ev: Any = self._stored(enc, [self._hash()], None, self._tokens(1), medium=medium)
        else:
            ev = enc.removed([self._hash()], medium=medium)
        # Lowercase names parse (vLLM's are upper case; we accept either); others are a bad field.
        return Sample("bad_medium", self._batch([ev], enc=enc))

    def _other_group(self) -> Sample:
        enc = self._encoders["0.33.0"]
        ev = self._stored(enc, [self._hash()], None, self._tokens(1), group_idx=self.rng.randint(1, 3))
        return Sample("other_group", self._batch([ev], enc=enc), frozenset({"other_group"}))

    def _offload_unknown(self) -> Sample:
        enc = self._encoders["0.33.0"]
        hashes = [self._hash() for _ in range(self.rng.randint(1, 4))]
        ev = enc.stored(hashes, None, [], 0, medium="CPU", group_idx=None)
        return Sample("offload_unknown", self._batch([ev], enc=enc), frozenset({"unknown_offload_block"}))

    def _bytes_hashes(self) -> Sample:
        enc = self._enc()
        n = self.rng.randint(1, 3)
        hashes: list[Any] = [self.rng.randbytes(self.rng.choice((0, 1, 8, 32, 100))) for _ in range(n)]
        ev = self._stored(enc, hashes, None, self._tokens(n))
        return Sample("bytes_hashes", self._batch([ev], enc=enc))

    # ------------------------------------------------------------------ shapes
    def _unknown_tag(self) -> Sample:
        ev: Any = (
            ["BlockMoved", [1, 2], "GPU"]
            if self.rng.random() < 0.5
            else {"type": "KVTransferStarted", "block_hashes": [1]}
        )
        return Sample("unknown_tag", _ENC.encode([1.7e9, [ev], 0]), frozenset({"unknown_tag"}))

    def _extra_fields(self) -> Sample:
        h = self._hash()
        self._remember([h])
        tokens = self._tokens(1)
        if self.rng.random() < 0.5:
            ev: Any = ["BlockStored", [h], None, tokens, self.bs, None, "GPU", None, None, 0, *range(20)]
        else:
            ev = {"type": "BlockStored", "block_hashes": [h], "token_ids": tokens, "block_size": self.bs}
            ev.update({f"future_field_{i}": [i] for i in range(8)})
        return Sample("extra_fields", _ENC.encode([1.7e9, [ev], 0]))

    def _map_batch(self) -> Sample:
        h = self._hash()
        self._remember([h])
        ev = ["BlockStored", [h], None, self._tokens(1), self.bs, None, "GPU"]
        body: dict[str, Any] = {"ts": 1.7e9, "events": [ev]}
        if self.rng.random() < 0.5:
            body["data_parallel_rank"] = 0
        return Sample("map_batch", _ENC.encode(body))

    def _bad_batch(self) -> Sample:
        r = self.rng
        ev = ["AllBlocksCleared"]
        body = r.choice(
            (
                ["1.7e9", [ev], 0],
                [1.7e9, [ev], -1],
                [1.7e9, [ev], 1 << 63],
                [1.7e9, [ev], "0"],
                [1.7e9],
                [1.7e9, {"a": 1}, 0],
                [1.7e9, None, 0],
                [1.7e9, "events", 0],
                [],
                {"ts": 1.7e9},
                {"events": [ev]},
                7,
                "batch",
                None,
            )
        )
        return Sample("bad_batch", _ENC.encode(body), frozenset({"batch_shape", "events_shape", "msgpack"}))

    def _empty_batch(self) -> Sample:
        return Sample("empty_batch", _ENC.encode([1.7e9, [], 0]))

    # ------------------------------------------------------------------ bytes
    def _truncated(self) -> Sample:
        p = self._valid_bytes()
        return Sample("truncated", p[: self.rng.randrange(len(p))])

    def _bitflip(self) -> Sample:
        p = bytearray(self._valid_bytes())
        for _ in range(self.rng.randint(1, 8)):
            p[self.rng.randrange(len(p))] = self.rng.randrange(256)
        return Sample("bitflip", bytes(p))

    def _garbage(self) -> Sample:
        n = self.rng.choice((0, 1, 2, 9, 50, 500))
        return Sample("garbage", self.rng.randbytes(n))

    def _claimed_huge(self) -> Sample:
        """Array headers claiming 2**32 - 1 elements over a few bytes: nothing may be allocated for them."""
        ts = b"\xcb" + struct.pack(">d", 1.7e9)
        stored = b"\xab" + b"BlockStored"
        body = self.rng.choice(
            (
                b"\x93" + ts + b"\xdd\xff\xff\xff\xff" + b"\x90",
                b"\x93" + ts + b"\x91\x9c" + stored + b"\xdd\xff\xff\xff\xff\x01",
                b"\x93" + ts + b"\x91\x9c" + stored + b"\x91\x01\xc0\xdd\xff\xff\xff\xff\x01\x02",
                b"\x93" + ts + b"\x91\xdf\xff\xff\xff\xff\xa4type",
                b"\xdd\xff\xff\xff\xff" + ts,
            )
        )
        return Sample("claimed_huge", body)

    def _deep_nesting(self) -> Sample:
        depth = self.rng.choice((200, 900, 5000, 50_000))
        deep = b"\x91" * depth + b"\xc0"
        ts = b"\xcb" + struct.pack(">d", 1.7e9)
        if self.rng.random() < 0.5:
            body = b"\x93" + ts + b"\x91" + deep + b"\x00"  # an event that is only nesting
        else:
            # A BlockStored whose extra_keys nest: decodes near the limit, then cannot be re-encoded.
            h = _ENC.encode(self._hash())
            tokens = _ENC.encode(self._tokens(1))
            body = (
                b"\x93" + ts + b"\x91\x9a" + b"\xabBlockStored" + b"\x91" + h + b"\xc0" + tokens
                + _ENC.encode(self.bs) + b"\xc0\xa3GPU\xc0\x91" + deep + b"\x00\x00"
            )  # fmt: skip
        return Sample("deep_nesting", body)

    def _huge(self) -> Sample:
        enc = self._encoders["0.33.0"]
        n = self.rng.choice((50_000, 200_000))
        if self.rng.random() < 0.5:
            hashes = [self._hash() for _ in range(n)]
            ev: Any = self._stored(enc, hashes, None, [1] * (n * self.bs))
        else:
            ev = enc.removed([self._hash() for _ in range(n)])
        return Sample("huge_arrays", self._batch([ev], enc=enc))
