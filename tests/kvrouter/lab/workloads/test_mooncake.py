"""Mooncake traces: expansion of 512-token hash ids into engine blocks, options, and the shipped files."""

from __future__ import annotations

import gzip
import json
import math
import statistics
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvrouter.lab.workloads import (
    BlockContentCache,
    ChecksumMismatch,
    MooncakeOptions,
    TraceFormatError,
    id_reuse,
    load_mooncake,
    make_workload,
    prompt_tokens,
    reuse_ceiling,
    reuse_hits,
    shipped_trace,
    summarize,
)
from kvrouter.lab.workloads.mooncake import (
    PACKAGED_TRACE_DIR,
    MooncakeRow,
    check_sha256,
    read_rows,
    read_trace_bytes,
)

CONVERSATION = shipped_trace("conversation_trace.jsonl")
SYNTHETIC = shipped_trace("synthetic_trace.jsonl")
needs_traces = pytest.mark.skipif(
    not (CONVERSATION.exists() and SYNTHETIC.exists()), reason="shipped Mooncake traces not present"
)


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 600, "output_length": 9, "hash_ids": [0, 4]},
    {"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [5]},
]


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "small.jsonl", ROWS)


def test_expansion_keeps_equal_ids_identical(small: Path) -> None:
    w = load_mooncake(small)
    space = w.token_space
    t = [prompt_tokens(r, space) for r in w.requests]
    assert [len(x) for x in t] == [1100, 1500, 600, 512]
    assert [r.num_prompt_tokens for r in w.requests] == [1100, 1500, 600, 512]
    assert np.array_equal(t[0][:1024], t[1][:1024])  # ids 0, 1 shared
    assert (t[0][1024:1100] != t[1][1024:1100]).mean() > 0.9  # id 2 vs id 3
    assert np.array_equal(t[0][:512], t[2][:512])
    assert (t[3] != t[0][:512]).mean() > 0.9  # id 5 differs from id 0
    assert all(x.min() >= space.low and x.max() < space.vocab_size for x in t)
    # 16-token engine blocks: 32 per id, the partial tail's full blocks included.
    cache = BlockContentCache(space, 16)
    h = [cache.content_hashes(r) for r in w.requests]
    assert [len(x) for x in h] == [68, 93, 37, 32]
    assert np.array_equal(h[0][:64], h[1][:64]) and not np.array_equal(h[0][64:68], h[1][64:68])


def test_partial_tail_is_prefix_of_the_same_id(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
    ]
    w = load_mooncake(write_trace(tmp_path / "t.jsonl", rows))
    a, b = (prompt_tokens(r, w.token_space) for r in w.requests)
    assert np.array_equal(a, b[:700])
    assert reuse_ceiling(w, 16) == pytest.approx(688 / 1724)  # 43 full blocks of the 700-token prompt


def test_arrivals_and_options(small: Path) -> None:
    w = load_mooncake(small)
    assert [r.arrival_s for r in w.requests] == [0.0, 1.5, 3.0, 3.0]
    assert [r.max_output_tokens for r in w.requests] == [5, 7, 9, 1]
    assert w.requests[1].id == "small-000001"
    fast = load_mooncake(small, MooncakeOptions(rate_multiplier=2.0))
    assert [r.arrival_s for r in fast.requests] == [0.0, 0.75, 1.5, 1.5]
    cut = load_mooncake(small, MooncakeOptions(offset=1, limit=2))
    assert [r.id for r in cut.requests] == ["small-000001", "small-000002"]
    assert [r.arrival_s for r in cut.requests] == [0.0, 1.5]
    late = load_mooncake(small, MooncakeOptions(start_s=2.0))
    assert [r.arrival_s for r in late.requests] == [1.0, 1.0]
    # Tokens do not depend on the selection, only on (seed, trace name, id).
    assert np.array_equal(
        prompt_tokens(cut.requests[0], w.token_space), prompt_tokens(w.requests[1], w.token_space)
    )
    other = load_mooncake(small, MooncakeOptions(seed=1))
    assert not np.array_equal(
        prompt_tokens(other.requests[0], w.token_space), prompt_tokens(w.requests[0], w.token_space)
    )


def test_format_errors(tmp_path: Path) -> None:
    bad_count = [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1]}]
    with pytest.raises(TraceFormatError, match=":1: 2 hash ids for 1100 tokens"):
        load_mooncake(write_trace(tmp_path / "a.jsonl", bad_count))
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(TraceFormatError, match=":2:"):
        load_mooncake(p)
    with pytest.raises(TraceFormatError):
        read_rows(b'{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n')


def test_checksum_mismatch_warns(tmp_path: Path) -> None:
    fake = write_trace(tmp_path / "conversation_trace.jsonl", ROWS)
    with pytest.warns(ChecksumMismatch, match="differs from the published"):
        w = load_mooncake(fake)
    assert len(w.requests) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_mooncake(fake, MooncakeOptions(verify_checksum=False))


def id_level_hits(rows: list[MooncakeRow], block_size: int) -> list[int]:
    """Reference from hash ids alone: 16-token block j of id h is identified by (h, j) since the id stands
    for its whole prefix; only full engine blocks are cached; vLLM's last-token rule."""
    per_id = 512 // block_size
    seen: set[tuple[int, int]] = set()
    hits = []
    for row in rows:
        blocks = [
            (h, j)
            for i, h in enumerate(row.hash_ids)
            for j in range(per_id)
            if (i * per_id + j + 1) * block_size <= row.input_length
        ]
        k = 0
        while k < len(blocks) and blocks[k] in seen:
            k += 1
        hits.append(min(k, (row.input_length - 1) // block_size) * block_size)
        seen.update(blocks)
    return hits


def raw_rows(path: Path) -> list[dict[str, int | list[int]]]:
    """The trace's lines parsed here, without the loader: the reference the loader is held to."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def prefix_reuse(rows: list[dict[str, int | list[int]]]) -> float:
    """Reference for ``id_reuse`` in other terms: a request reuses the longest run of its leading hash ids
    that some earlier request started with (512 tokens each, capped at its length), over all prompt tokens.
    Equal to counting leading ids already seen exactly when equal ids stand for equal prefixes, as the
    traces' README says they do."""
    node: dict[tuple[int, int], int] = {}  # (prefix node, next id) -> prefix node; 0 is the empty prefix
    hit = total = 0
    for row in rows:
        ids, n = row["hash_ids"], row["input_length"]
        assert isinstance(ids, list) and isinstance(n, int)
        at, k = 0, 0
        while k < len(ids) and (at, ids[k]) in node:
            at, k = node[(at, ids[k])], k + 1
        hit += min(k * 512, n)
        total += n
        for h in ids[k:]:
            at = node.setdefault((at, h), len(node) + 1)
    return hit / total


@needs_traces
@pytest.mark.parametrize(("path", "requests"), [(CONVERSATION, 12031), (SYNTHETIC, 3993)])
def test_shipped_traces_full_file_stats(path: Path, requests: int) -> None:
    """The README table's columns, over the whole files (no hashing: fast), against the same figures
    computed here from the raw lines.  The request counts are the traces README's; the files are the
    published ones (sha256-checked by the loader: a changed file fails under filterwarnings=error)."""
    rows = raw_rows(path)
    s = summarize(load_mooncake(path), ceiling=False)
    inputs = [int(r["input_length"]) for r in rows]  # type: ignore[call-overload]
    outputs = [int(r["output_length"]) for r in rows]  # type: ignore[call-overload]
    stamps = [int(r["timestamp"]) for r in rows]  # type: ignore[call-overload]
    span = (max(stamps) - min(stamps)) / 1000
    assert s["requests"] == len(rows) == requests
    assert s["span_s"] == pytest.approx(span)
    assert s["mean_rate_rps"] == pytest.approx(len(rows) / span)
    assert s["input_mean"] == pytest.approx(statistics.fmean(inputs))
    assert s["input_p50"] == statistics.median(inputs) and s["input_max"] == max(inputs)
    assert s["input_tokens_total"] == sum(inputs)
    assert s["output_mean"] == pytest.approx(statistics.fmean(outputs))
    # The traces README's reuse figures are id-level (see id_reuse).
    reuse = id_reuse(read_rows(read_trace_bytes(path)))
    assert reuse == pytest.approx(prefix_reuse(rows), abs=1e-12)
    assert 0.0 < reuse < 1.0


@needs_traces
@pytest.mark.parametrize("block_size", [16, 512])
def test_shipped_trace_head_ceiling_matches_ids(block_size: int) -> None:
    """Token-level expansion of the first 400 requests agrees with the id-level reference."""
    w = load_mooncake(CONVERSATION, MooncakeOptions(limit=400))
    rows = read_rows(read_trace_bytes(CONVERSATION))[:400]
    assert reuse_hits(w, block_size).tolist() == id_level_hits(rows, block_size)


@needs_traces
def test_registry_loads_shipped_trace() -> None:
    w = make_workload("mooncake-synthetic", limit=50)
    assert len(w.requests) == 50 and w.metadata["hints"]["instances"] == 8
    assert w.requests[0].id == "mooncake-synthetic-000000"
    assert math.isclose(w.requests[0].arrival_s or 0.0, 0.0)


@needs_traces
@pytest.mark.slow
@pytest.mark.parametrize(("path", "block_size"), [(CONVERSATION, 512), (CONVERSATION, 16), (SYNTHETIC, 16)])
def test_shipped_traces_full_ceilings(path: Path, block_size: int) -> None:
    """Whole-file token-level ceilings (several seconds each; ``make reliability``) equal the id-level
    reference over the whole file, and never exceed the id-level reuse that ignores the last-token rule."""
    w = load_mooncake(path)
    rows = read_rows(read_trace_bytes(path))
    total = sum(r.input_length for r in rows)
    ceiling = reuse_ceiling(w, block_size)
    assert ceiling == pytest.approx(sum(id_level_hits(rows, block_size)) / total, abs=1e-12)
    assert ceiling <= id_reuse(rows)


@pytest.mark.parametrize("file", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_packaged_traces_are_the_published_files(file: str) -> None:
    packed = PACKAGED_TRACE_DIR / f"{file}.gz"
    assert check_sha256(packed, gzip.decompress(packed.read_bytes())) is None
    w = load_mooncake(packed, MooncakeOptions(limit=5))  # fails on a ChecksumMismatch warning
    assert w.name == file.removesuffix("_trace.jsonl") and len(w.requests) == 5
