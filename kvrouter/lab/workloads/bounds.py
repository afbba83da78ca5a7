"""The reuse ceiling: what an infinite, never-evicting single cache would serve.

Counted as vLLM counts a prefix-cache hit (``KVCacheManager.get_computed_blocks``): whole blocks only, and
never the prompt's last token (``hit_blocks = min(leading cached blocks, (num_tokens - 1) //
block_size)``), so a prompt found in full still recomputes its last block.

Requests are taken in release order; each one's full blocks enter the cache after its lookup (with the
full blocks of prompt + output minus its last token when the workload says what the engine generates:
vLLM caches decode blocks too).  Blocks are keyed by the indexer's chain hash under the request's
``cache_salt``, so tenants under different salts never share.  Concurrency is ignored.

Invariant: the set of cached chain hashes is prefix-closed (a block's hash is only ever inserted with all
its predecessors'), so the leading cached run is found by binary search, and only missed blocks are
inserted.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from indexer.hashing import I64Array, base_hash, chain
from kvrouter.lab.workloads.blocks import BlockContentCache
from kvrouter.lab.workloads.spec import Request, Segment, Workload


def _leading_present(chained: list[int], seen: set[int]) -> int:
    """Length of the leading run of ``chained`` in ``seen``, given that ``seen`` is prefix-closed."""
    lo, hi = 0, len(chained)
    while lo < hi:
        mid = (lo + hi) // 2
        if chained[mid] in seen:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _with_output(request: Request) -> tuple[Segment, ...] | None:
    """Segments of prompt + output without its last token, or None when the output is unknown."""
    if request.token_ids is not None or not request.output_segments:
        return None
    out = list(request.output_segments)
    last = out[-1]
    out[-1] = Segment(last.key, max(last.length - 1, 0))
    return request.segments + tuple(out)


def reuse_hits(
    workload: Workload,
    block_size: int = 16,
    *,
    count_outputs: bool = True,
    cache: BlockContentCache | None = None,
) -> npt.NDArray[np.int64]:
    """Prompt tokens each request (in ``workload.requests`` order) would find in an infinite cache."""
    if cache is None or cache.block_size != block_size or cache.space != workload.token_space:
        cache = BlockContentCache(workload.token_space, block_size)
    cache.warm(workload.requests)
    seen: set[int] = set()
    hits = np.zeros(len(workload.requests), dtype=np.int64)
    bases: dict[str | None, int] = {}
    for i, req in enumerate(workload.requests):
        base = bases.get(req.cache_salt)
        if base is None:
            base = bases[req.cache_salt] = base_hash(None, req.cache_salt)
        chained: list[int] = chain(cache.content_hashes(req), base).tolist()
        cached = _leading_present(chained, seen)
        limit = max(req.num_prompt_tokens - 1, 0) // block_size
        hits[i] = min(cached, limit) * block_size
        seen.update(chained[cached:])
        if count_outputs and (longer := _with_output(req)) is not None:
            grown: I64Array = chain(cache.segments_hashes(longer), base)
            seen.update(grown[len(chained) :].tolist())
    return hits


def reuse_ceiling(
    workload: Workload,
    block_size: int = 16,
    *,
    count_outputs: bool = True,
    cache: BlockContentCache | None = None,
) -> float:
    """Fraction of all prompt tokens an infinite single cache would serve (0 for an empty workload)."""
    hits = reuse_hits(workload, block_size, count_outputs=count_outputs, cache=cache)
    total = sum(r.num_prompt_tokens for r in workload.requests)
    return float(hits.sum()) / total if total else 0.0


def reuse_ceiling_by(
    workload: Workload,
    key: Callable[[Request], str | None],
    block_size: int = 16,
    *,
    count_outputs: bool = True,
    cache: BlockContentCache | None = None,
) -> dict[str | None, float]:
    """The ceiling per class of request (e.g. ``key=lambda r: r.tenant``), from one shared cache."""
    hits = reuse_hits(workload, block_size, count_outputs=count_outputs, cache=cache)
    got: dict[str | None, int] = {}
    total: dict[str | None, int] = {}
    for req, h in zip(workload.requests, hits.tolist()):
        k = key(req)
        got[k] = got.get(k, 0) + h
        total[k] = total.get(k, 0) + req.num_prompt_tokens
    return {k: (got[k] / total[k] if total[k] else 0.0) for k in total}
