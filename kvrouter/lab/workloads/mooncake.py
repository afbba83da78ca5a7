"""Mooncake-format traces (FAST'25 release): real arrival times, lengths and prefix identity, no text.

One JSON object a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ..., 2354]}

``hash_ids[j]`` stands for tokens ``512 j .. 512 (j+1)`` *and everything before them*; the last id covers
``input_length - 512 (len - 1)`` tokens.  Each id becomes one segment whose stream key is derived from
(seed, trace name, id), so equal ids give equal 512 tokens (prefixes match block for block), different
ids different tokens, and a partial last id the first ``tail`` tokens of that id's stream (the prefix of
the same id used in full).

Loading decodes with msgspec and derives keys in one numpy pass; the evaluator's block hashes come from
``BlockContentCache.warm`` (per-id cache).
"""

from __future__ import annotations

import gzip
import hashlib
import math
import warnings
from pathlib import Path
from types import MappingProxyType

import msgspec
import numpy as np
from msgspec import Struct

from kvrouter.lab.workloads.errors import ChecksumMismatch, TraceFormatError
from kvrouter.lab.workloads.spec import OpenLoop, Request, Segment, TokenSpace, Workload, plain
from kvrouter.lab.workloads.tokens import derive_key, derive_keys

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens covered by one Mooncake hash id."""

DEFAULT_TRACE_DIR = Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake"
"""Where the traces live in this checkout's workspace (``../shared/traces/mooncake``), when there is one."""

PACKAGED_TRACE_DIR = Path(__file__).resolve().parent / "traces"
"""The same two traces, gzipped, shipped inside the package (Apache-2.0, see its README), so that
``--workload mooncake-conversation`` works after ``pip install`` and on a machine without the workspace."""


def shipped_trace(file: str) -> Path:
    """A shipped trace by its published name (``conversation_trace.jsonl``): the workspace's copy if there
    is one, else the packaged ``.gz`` (the same bytes once decompressed: the sha256 check covers both)."""
    p = DEFAULT_TRACE_DIR / file
    return p if p.exists() else PACKAGED_TRACE_DIR / f"{file}.gz"


PUBLISHED_SHA256 = MappingProxyType(
    {
        "conversation_trace.jsonl": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        "synthetic_trace.jsonl": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    }
)
"""sha256 of the shipped files, as given in the traces README (the figures quoted there are theirs)."""


class MooncakeRow(Struct, frozen=True, gc=False):
    """One line of a Mooncake trace."""

    timestamp: int
    """Arrival, milliseconds from the start of the trace."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens."""
    hash_ids: list[int]
    """One id per 512-token block, each standing for its block and everything before it."""


class MooncakeOptions(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to turn a trace file into a workload."""

    seed: int = 0
    """Seeds the token streams (not the shape, which is the trace's)."""
    token_space: TokenSpace = TokenSpace()
    """Token ids the streams draw from."""
    rate_multiplier: float = 1.0
    """Send ``x`` times faster than recorded (timestamps divided by it)."""
    offset: int = 0
    """Skip this many requests from the start of the file."""
    start_s: float = 0.0
    """Skip requests recorded before this time (seconds); arrivals are then counted from it."""
    limit: int | None = None
    """Keep at most this many requests (after ``offset`` and ``start_s``)."""
    verify_checksum: bool = True
    """Warn (``ChecksumMismatch``) when a shipped file's sha256 differs from the published one."""

    def __post_init__(self) -> None:
        if not self.rate_multiplier > 0:
            raise ValueError(f"rate_multiplier must be > 0, got {self.rate_multiplier}")
        if self.offset < 0 or (self.limit is not None and self.limit < 0) or self.start_s < 0:
            raise ValueError("offset, limit and start_s must be >= 0")


_DECODER = msgspec.json.Decoder(MooncakeRow)


def check_sha256(path: Path, data: bytes) -> str | None:
    """The published digest's mismatch message, or None (also for files that are not shipped ones)."""
    expected = PUBLISHED_SHA256.get(path.name.removesuffix(".gz"))
    if expected is None:
        return None
    actual = hashlib.sha256(data).hexdigest()
    if actual == expected:
        return None
    return f"{path}: sha256 {actual} differs from the published {expected}; figures may not compare"


def read_rows(data: bytes, source: str = "<trace>") -> list[MooncakeRow]:
    """Decode and validate every line.  Raises ``TraceFormatError`` naming the first bad line."""
    try:
        rows = _DECODER.decode_lines(data)
    except msgspec.DecodeError:
        rows = None
    if rows is None:
        for lineno, line in enumerate(data.splitlines(), 1):
            if line.strip():
                try:
                    _DECODER.decode(line)
                except msgspec.DecodeError as e:
                    raise TraceFormatError(f"{source}:{lineno}: {e}") from None
        raise TraceFormatError(f"{source}: undecodable")
    for lineno, row in enumerate(rows, 1):
        if row.input_length < 1 or row.output_length < 0:
            raise TraceFormatError(f"{source}:{lineno}: lengths must be positive")
        if len(row.hash_ids) != math.ceil(row.input_length / MOONCAKE_BLOCK_TOKENS):
            raise TraceFormatError(
                f"{source}:{lineno}: {len(row.hash_ids)} hash ids for {row.input_length} tokens "
                f"(expected ceil(input_length / {MOONCAKE_BLOCK_TOKENS}))"
            )
    return rows


def select_rows(rows: list[MooncakeRow], options: MooncakeOptions) -> list[tuple[int, MooncakeRow]]:
    """``(line index from 0, row)`` of the rows the options keep."""
    start_ms = options.start_s * 1000.0
    kept = [(i, r) for i, r in enumerate(rows) if i >= options.offset and r.timestamp >= start_ms]
    return kept if options.limit is None else kept[: options.limit]


def rows_to_workload(rows: list[tuple[int, MooncakeRow]], name: str, options: MooncakeOptions) -> Workload:
    """The workload for selected ``(line index, row)`` pairs, in file order (Mooncake files are sorted by
    time).  Request ids carry the line index, so a request keeps its id whatever the selection."""
    namespace = derive_key(options.seed, "mooncake", name)
    all_ids = np.fromiter((h for _, r in rows for h in r.hash_ids), dtype=np.int64)
    keys: list[int] = derive_keys(namespace, all_ids).tolist()
    origin_ms = options.start_s * 1000.0 if options.start_s else (rows[0][1].timestamp if rows else 0)
    scale = 1.0 / (1000.0 * options.rate_multiplier)
    full = MOONCAKE_BLOCK_TOKENS
    requests = []
    pos = 0
    for index, row in rows:
        m = len(row.hash_ids)
        segments = [Segment(k, full) for k in keys[pos : pos + m]]
        segments[-1] = Segment(keys[pos + m - 1], row.input_length - full * (m - 1))
        pos += m
        requests.append(
            Request(
                id=f"{name}-{index:06d}",
                arrival_s=(row.timestamp - origin_ms) * scale,
                max_output_tokens=row.output_length,
                num_prompt_tokens=row.input_length,
                segments=tuple(segments),
            )
        )
    return Workload(
        name=name,
        requests=requests,
        mode=OpenLoop(),
        token_space=options.token_space,
        metadata={
            "generator": "mooncake",
            "params": plain(options),
            "hints": {},
            "mooncake_block_tokens": MOONCAKE_BLOCK_TOKENS,
        },
    )


def read_trace_bytes(path: Path) -> bytes:
    """A trace file's JSONL bytes (``.gz`` files decompressed)."""
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def load_mooncake(
    path: str | Path, options: MooncakeOptions | None = None, name: str | None = None
) -> Workload:
    """Load a Mooncake trace file as a workload (open loop, trace arrival times).

    ``name`` defaults to the file's stem without ``_trace`` (``conversation``, ``synthetic``); it namespaces
    the token streams, so two traces never share content by accident."""
    path = Path(path)
    options = options or MooncakeOptions()
    data = read_trace_bytes(path)
    if options.verify_checksum and (problem := check_sha256(path, data)):
        warnings.warn(problem, ChecksumMismatch, stacklevel=2)
    rows = select_rows(read_rows(data, str(path)), options)
    stem = Path(path.name.removesuffix(".gz")).stem
    workload = rows_to_workload(rows, name or stem.removesuffix("_trace"), options)
    workload.metadata["source"] = str(path)
    return workload


def id_reuse(rows: list[MooncakeRow]) -> float:
    """The traces README's "reuse ceiling": per request, the leading hash ids already seen times 512
    tokens (capped at its length), over all prompt tokens.

    It counts a reused partial last block in full and ignores vLLM's last-token rule; ``reuse_ceiling``
    at ``block_size=512`` counts as vLLM does (see ``bounds.py``)."""
    seen: set[int] = set()
    hit = total = 0
    for row in rows:
        k = 0
        while k < len(row.hash_ids) and row.hash_ids[k] in seen:
            k += 1
        hit += min(k * MOONCAKE_BLOCK_TOKENS, row.input_length)
        total += row.input_length
        seen.update(row.hash_ids)
    return hit / total if total else 0.0
