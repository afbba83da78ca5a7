"""Record the KV events of vLLM's own OffloadingConnector (CPU tier) with seeded requests (dev tool).

Runs vLLM 0.33.0's ``Scheduler`` with ``kv_transfer_config`` = the ``OffloadingConnector`` (scheduler role,
its ``CPUOffloadingManager`` with the LRU policy) and KV events on, without a GPU or a model, as
``record_vllm_scheduler.py`` runs the scheduler alone.  The worker side (the copies between GPU and CPU)
is stood in for by the fake model output: every store and load job the step's connector metadata lists
is reported complete in that step's ``KVConnectorOutput`` (``OffloadingWorkerMetadata.completed_jobs``,
and ``finished_recving`` for asynchronous loads), as a worker whose copies take no time would report.

Recorded per scenario (tests/fixtures/vllm_offload/<scenario>.json), beside the scheduler recorder's
fields (requests with ``num_cached_tokens``, steps with the published payload and a summary):

* ``cpu``: after each step, the block hashes of the chunks the CPU manager holds ready (its LRU policy's
  entries, as the ints vLLM's events carry): the truth an index of the CPU tier should equal;
* ``loads``: tokens the connector loads from CPU for each request admitted in the step;
* the connector's settings (``self_describing_kv_events``, ``blocks_per_chunk``).

Run with the vLLM venv: ``/work/vllm/venv/bin/python tools/record_vllm_offload.py [--check]``
(``make golden-offload``).  Block hashes are sha256 with vLLM's fixed default NONE_HASH seed; the process
runs with PYTHONHASHSEED=0 (set here) for the order of set iteration.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if os.environ.get("PYTHONHASHSEED") != "0":
    # The connector announces a batch's chunks in the iteration order of a set of bytes keys, which
    # Python's hash randomisation changes per process: a fixed seed makes recordings reproducible.
    # Checked before importing the scheduler recorder, which drops the variable from the environment
    # (so vLLM seeds NONE_HASH from its fixed default, as for the scheduler fixtures).
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record_vllm_scheduler import Req, _dump, _toks, _vllm_version, _write_model_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_offload"
VOCAB = 1000


@dataclass
class Scenario:
    name: str
    doc: str
    num_blocks: int
    """GPU blocks (the null block included)."""
    cpu_chunks: int
    """Chunks the CPU tier holds (``cpu_bytes_to_use`` is set to exactly this many aligned chunks)."""
    self_describing: bool
    blocks_per_chunk: int = 1
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 256
    block_size: int = 16
    max_model_len: int = 2048
    requests: list[Req] = field(default_factory=list)


def _traffic(seed: int) -> list[Req]:
    """A system prompt reused across long distinct prompts that push it out of a small GPU pool: later
    requests find it on CPU (loads), the CPU tier evicts least recently used chunks."""
    rng = random.Random(seed)
    system = _toks(rng, 64)
    return [
        Req("a", 0, system + _toks(rng, 20), 3),
        Req("b", 8, _toks(rng, 100), 3),
        Req("c", 16, _toks(rng, 120), 3),
        Req("d", 24, system + _toks(rng, 30), 3),
        Req("e", 30, _toks(rng, 90), 2),
        Req("f", 36, system + _toks(rng, 5), 2),
        Req("g", 40, _toks(rng, 150), 2),
        Req("h", 48, system + _toks(rng, 40), 2),
    ]


def _whole_prompts(seed: int) -> list[Req]:
    """Block-aligned prompts met again once they have left the GPU: the CPU tier holds every block of
    them, and vLLM loads all of it (then recomputes the last token); two at once share a prefix whose
    chunks one of them is loading."""
    rng = random.Random(seed)
    system = _toks(rng, 64)
    return [
        Req("a", 0, list(system), 2),
        Req("b", 4, system + _toks(rng, 32), 2),
        Req("c", 8, _toks(rng, 100), 2),
        Req("d", 16, _toks(rng, 120), 2),
        Req("e", 24, list(system), 2),
        Req("f", 30, _toks(rng, 150), 2),
        Req("g", 38, system + _toks(rng, 16), 2),
        Req("h", 38, list(system), 2),
    ]


def _eviction_order(seed: int) -> list[Req]:
    """Evictions while requests run: a long prompt prefilled 32 tokens a step stores chunk after chunk into
    a tier of 6 (evicting a running request's tail first, then its own earlier tail chunks); a prompt
    whose prefix is still on GPU but evicted from CPU (stored again); a prefix reused by a request that
    runs long while another prompt fills the tier."""
    rng = random.Random(seed)
    q = _toks(rng, 48)
    return [
        Req("q", 0, q, 2),
        Req("p", 1, _toks(rng, 160), 2),
        Req("r", 6, q + _toks(rng, 16), 2),
        Req("s", 12, q + _toks(rng, 16), 12),
        Req("t", 14, _toks(rng, 96), 2),
    ]


def scenarios() -> list[Scenario]:
    out = []
    for self_describing in (False, True):
        for bpc in (1, 2):
            kind = "self_describing" if self_describing else "placeholders"
            out.append(
                Scenario(
                    f"cpu_{kind}_chunk{bpc}",
                    f"OffloadingConnector, CPU tier of {24 // bpc} chunks of {bpc} block(s), "
                    f"self_describing_kv_events={self_describing}; a 14-block GPU pool, a 64-token system "
                    "prompt pushed out of the GPU by long prompts and found again on CPU; later prompts "
                    "make the CPU tier evict.",
                    num_blocks=14,
                    cpu_chunks=24 // bpc,
                    self_describing=self_describing,
                    blocks_per_chunk=bpc,
                    requests=_traffic(17),
                )
            )
    out.append(
        Scenario(
            "cpu_placeholders_whole_prompts",
            "OffloadingConnector, CPU tier of 24 one-block chunks, placeholders; a 14-block GPU pool; a "
            "64-token system prompt asked alone again after long prompts pushed it out of the GPU (loaded "
            "whole from CPU, reported cached whole), then asked by two requests in one step (the second "
            "waits for the first one's load).",
            num_blocks=14,
            cpu_chunks=24,
            self_describing=False,
            requests=_whole_prompts(29),
        )
    )
    out.append(
        Scenario(
            "cpu_placeholders_eviction_order",
            "OffloadingConnector, CPU tier of 6 one-block chunks, placeholders; a 20-block GPU pool and "
            "32 tokens a step: evictions while the storing requests still run (which chunk goes first).",
            num_blocks=20,
            cpu_chunks=6,
            self_describing=False,
            max_num_batched_tokens=32,
            requests=_eviction_order(31),
        )
    )
    return out


def run(sc: Scenario, model_dir: str) -> dict[str, Any]:
    import msgspec
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_events import EventPublisher, KVEventBatch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        BlockHash,
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.kv_offload.base import get_offload_block_hash
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    published: list[KVEventBatch] = []

    class Recorder(EventPublisher):
        def __init__(self, data_parallel_rank: int = 0, **_: Any) -> None:
            super().__init__(data_parallel_rank)

        def publish(self, events: Any) -> None:
            if events.data_parallel_rank is None:
                events.data_parallel_rank = self._data_parallel_rank
            published.append(events)

        def shutdown(self) -> None:
            pass

    bs = sc.block_size
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)
    page = spec.page_size_bytes
    align = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    chunk_bytes = -(-page * sc.blocks_per_chunk // align) * align
    model = ModelConfig(
        model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, max_model_len=sc.max_model_len
    )
    vc = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=sc.max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "cpu_bytes_to_use": chunk_bytes * sc.cpu_chunks,
                "blocks_per_chunk": sc.blocks_per_chunk,
                "self_describing_kv_events": sc.self_describing,
            },
        ),
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = sc.num_blocks
    kvc = KVCacheConfig(
        num_blocks=sc.num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * sc.num_blocks,
                layers=["layer0"],
                layer_stride=page * sc.num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)],
    )
    sched = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=bs, log_stats=True)
    sched.kv_event_publisher = Recorder()
    connector: Any = sched.connector
    manager = connector.connector_scheduler.manager
    init_none_hash(sha256)
    hasher = get_request_block_hasher(bs, sha256)
    rng = random.Random(f"outputs/{sc.name}")
    outputs: dict[str, list[int]] = {r.rid: [] for r in sc.requests}
    cached: dict[str, int] = {}
    steps: list[dict[str, Any]] = []
    enc = msgspec.msgpack.Encoder()
    pending = sorted(sc.requests, key=lambda r: r.arrival)
    step = 0

    def cpu_resident() -> list[int]:
        chunks = manager._policy.chunks  # the LRU policy's entries: key -> chunk status
        return sorted(
            int(maybe_convert_block_hash(BlockHash(get_offload_block_hash(k))))
            for k, c in chunks.items()
            if c.is_ready
        )

    while pending or sched.get_num_unfinished_requests():
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            sched.add_request(
                Request(
                    r.rid,
                    list(r.prompt),
                    SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                    None,
                    block_hasher=hasher,
                )
            )
        so = sched.schedule()
        meta = so.kv_connector_metadata
        completed: dict[int, int] = {}
        received: set[str] = set()
        loads: dict[str, int] = {}
        if meta is not None:
            completed.update((j, 1) for j in meta.store_jobs)
            for j, job in meta.load_jobs.items():
                completed[j] = 1
                if not job.sync:
                    received.add(job.req_id)
                loads[job.req_id] = loads.get(job.req_id, 0) + 1
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            req = sched.requests[rid]
            sampled.append([rng.randrange(1, VOCAB)] if req.num_computed_tokens >= req.num_tokens else [])
        worker_meta = OffloadingWorkerMetadata(completed_jobs=completed) if completed else None
        kvo = KVConnectorOutput(finished_recving=received or None, kv_connector_worker_meta=worker_meta)
        res = sched.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kvo,
            ),
        )
        for eco in res.values():
            for o in eco.outputs:
                outputs[o.request_id] += list(o.new_token_ids)
                if o.prefill_stats is not None:
                    cached.setdefault(o.request_id, o.prefill_stats.num_cached_tokens)
        assert len(published) <= 1, "one batch per step"
        batch = published.pop() if published else None
        rec: dict[str, Any] = {
            "step": step,
            "scheduled": dict(so.num_scheduled_tokens),
            "load_jobs": loads,
            "cpu": cpu_resident(),
        }
        if batch is not None:
            batch.ts = float(step)
            rec["events"] = " ".join(_summary(e) for e in batch.events)
            rec["payload"] = enc.encode(batch).hex()
        steps.append(rec)
        step += 1
        if step > 2000:
            raise RuntimeError(f"{sc.name}: no progress")
    return {
        "scenario": sc.name,
        "doc": sc.doc,
        "vllm": _vllm_version(),
        "config": {
            "block_size": bs,
            "num_gpu_blocks": sc.num_blocks,
            "cpu_chunks": sc.cpu_chunks,
            "blocks_per_chunk": sc.blocks_per_chunk,
            "self_describing_kv_events": sc.self_describing,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_model_len": sc.max_model_len,
        },
        "requests": [
            {
                "id": r.rid,
                "arrival": r.arrival,
                "prompt": r.prompt,
                "max_tokens": r.max_tokens,
                "outputs": outputs[r.rid],
                "num_cached_tokens": cached[r.rid],
            }
            for r in sc.requests
        ],
        "steps": steps,
    }


def _summary(ev: Any) -> str:
    """``S3<`` (stored 3 blocks after a parent), ``S2`` (from the start), a medium letter after it when not
    GPU (``S1c``: a CPU store; ``S1cp``: a CPU placeholder, no tokens), ``R``/``Rc3`` removed, ``C``."""
    kind = type(ev).__name__
    medium = "" if ev.__class__.__name__ == "AllBlocksCleared" or ev.medium in (None, "GPU") else "c"
    if kind == "BlockStored":
        return (
            f"S{len(ev.block_hashes)}"
            + ("<" if ev.parent_block_hash is not None else "")
            + medium
            + ("p" if medium and not ev.token_ids else "")
        )
    if kind == "BlockRemoved":
        return "R" + medium + (str(len(ev.block_hashes)) if len(ev.block_hashes) > 1 else "")
    return "C"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed fixtures, write nothing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="golden-model-") as model_dir:
        _write_model_config(model_dir)
        files = {f"{sc.name}.json": _dump(run(sc, model_dir)) for sc in scenarios()}
    if args.check:
        stale = [n for n, t in files.items() if not (OUT / n).exists() or (OUT / n).read_text() != t]
        if stale:
            print(f"vLLM offload fixtures out of date: {stale}", file=sys.stderr)
            return 1
        print(f"{len(files)} vLLM offload fixtures match a fresh recording")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for n, t in files.items():
        (OUT / n).write_text(t)
    print(f"wrote {len(files)} scenarios to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
