"""Record what vLLM's own v1 scheduler and block pool do with seeded request sequences (dev tool).

Runs vLLM 0.33.0's ``Scheduler`` + ``KVCacheManager`` + ``BlockPool`` without a GPU or a model: a model
config read from a ``config.json`` written here (nothing is loaded: the scheduler only needs its lengths),
a ``KVCacheConfig`` of N blocks of one full-attention group, prefix caching and KV events on.  Each step
calls ``schedule()`` and then ``update_from_output()`` with a fake model output: one sampled token for
every request whose computed tokens reach its known tokens after the step (none for a prefill chunk).

Recorded per scenario (tests/fixtures/vllm_scheduler/<scenario>.json):

* the configuration and, per request, its arrival step, prompt, max_tokens, cache_salt, LoRA, the output
  tokens the fake model gave it, and ``num_cached_tokens`` as vLLM reports it (the ``prefill_stats`` of
  its first output: the prefix-cache hit of its first scheduling, as ``usage.prompt_tokens_details``);
* per step: tokens scheduled per request, requests preempted, and the KV events the scheduler published
  (vLLM's ``KVEventBatch``, kept by an ``EventPublisher`` put in the scheduler's publisher slot) as the
  0.33 payload (``msgspec.msgpack`` of the batch, as ``ZmqEventPublisher`` encodes it; ``ts`` set to the
  step number so recordings are reproducible), with a one-line summary of its events.

Run with the vLLM venv: ``/work/vllm/venv/bin/python tools/record_vllm_scheduler.py [--check]``
(``make golden-scheduler``).  Block hashes are sha256 with vLLM's fixed default NONE_HASH seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("PYTHONHASHSEED", None)  # NONE_HASH from vLLM's fixed default seed

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "vllm_scheduler"
VOCAB = 1000


@dataclass
class Req:
    rid: str
    arrival: int
    prompt: list[int]
    max_tokens: int
    cache_salt: str | None = None
    lora: str | None = None


@dataclass
class Scenario:
    name: str
    doc: str
    num_blocks: int
    """vLLM's ``num_gpu_blocks``, the null block included (usable blocks: one fewer)."""
    max_num_seqs: int
    max_num_batched_tokens: int
    requests: list[Req] = field(default_factory=list)
    block_size: int = 16
    max_model_len: int = 2048
    max_loras: int = 0


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def scenarios() -> list[Scenario]:
    out: list[Scenario] = []
    rng = random.Random(2033)
    system = _toks(rng, 70)
    s = Scenario(
        "shared_prefix",
        "Chat-like turns over one system prompt, ample cache, chunked prefill (64-token budget): hits on "
        "the shared prefix, a request admitted in the step that caches what it hits, and a full-prompt "
        "hit (the last block is recomputed).",
        num_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    first = system + _toks(rng, 20)
    s.requests = [
        Req("a", 0, first, 4),
        Req("b", 0, system + _toks(rng, 9), 3),
        Req("c", 6, system + _toks(rng, 40), 5),
        Req("d", 12, list(first), 2),  # the same prompt again
        Req("e", 14, system[:48], 3),  # exactly three blocks, all cached
        Req("f", 20, system + _toks(rng, 3), 17),  # decodes across block boundaries
    ]
    out.append(s)

    rng = random.Random(7)
    s = Scenario(
        "evictions",
        "A 13-block pool (12 usable): distinct prompts evict the least recently freed blocks, later "
        "requests hit what survives; evicted parents leave holes.",
        num_blocks=13,
        max_num_seqs=2,
        max_num_batched_tokens=128,
    )
    p = [_toks(rng, 16 * k + 5) for k in (3, 4, 2, 5)]
    s.requests = [
        Req("p0", 0, p[0], 3),
        Req("p1", 4, p[1], 3),
        Req("p2", 8, p[2], 3),
        Req("p0-again", 12, p[0] + _toks(rng, 10), 2),
        Req("p3", 16, p[3], 3),
        Req("p1-again", 22, p[1], 2),
        Req("p0-third", 26, p[0], 2),
    ]
    out.append(s)

    rng = random.Random(11)
    s = Scenario(
        "preemption",
        "Three long decodes in a 10-block pool: the newest running request is preempted (recompute), "
        "its blocks freed, and it resumes from the prefix cache.",
        num_blocks=10,
        max_num_seqs=3,
        max_num_batched_tokens=256,
    )
    s.requests = [
        Req("long0", 0, _toks(rng, 30), 40),
        Req("long1", 0, _toks(rng, 30), 40),
        Req("long2", 1, _toks(rng, 20), 40),
        Req("after", 60, _toks(rng, 20), 2),
    ]
    out.append(s)

    rng = random.Random(5)
    shared = _toks(rng, 40)
    s = Scenario(
        "salt_lora",
        "One prompt under different cache salts and LoRA adapters: only identical (salt, adapter) pairs "
        "share blocks; the salt keys block 0, the adapter every block.",
        num_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_loras=2,
    )
    s.requests = [
        Req("plain", 0, [*shared, 5], 2),
        Req("salt-a", 3, [*shared, 6], 2, cache_salt="tenant-a"),
        Req("salt-a-2", 6, [*shared, 7], 2, cache_salt="tenant-a"),
        Req("salt-b", 9, [*shared, 8], 2, cache_salt="tenant-b"),
        Req("lora-x", 12, [*shared, 9], 2, lora="sql-x"),
        Req("lora-x-2", 15, [*shared, 10], 2, lora="sql-x"),
        Req("lora-y-salted", 18, [*shared, 11], 2, cache_salt="tenant-a", lora="sql-y"),
        Req("lora-y-salted-2", 21, [*shared, 12], 2, cache_salt="tenant-a", lora="sql-y"),
        Req("plain-2", 24, [*shared, 13], 2),
    ]
    out.append(s)

    for seed, blocks, budget, seqs in (
        (1, 24, 48, 4),
        (2, 16, 96, 4),
        (3, 40, 32, 4),
        (4, 12, 64, 2),
        (5, 30, 128, 8),
    ):
        out.append(_random(seed, blocks, budget, seqs))
    return out


def _random(seed: int, num_blocks: int, budget: int, max_num_seqs: int) -> Scenario:
    """Seeded mixed traffic: 30 requests over 4 shared prefixes with random suffixes, arrivals (several
    in one step), output lengths, salts and adapters, in a pool small enough to evict and preempt."""
    rng = random.Random(seed)
    prefixes = [_toks(rng, rng.randrange(16, 70)) for _ in range(4)]
    s = Scenario(
        f"random_{seed}",
        f"Seed {seed}: 30 requests over 4 shared prefixes (random suffixes, arrivals, lengths; some salted, "
        f"some on one of two adapters), {num_blocks} blocks, {budget}-token step budget, "
        f"{max_num_seqs} running at most.",
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_loras=2,
    )
    t = 0
    for i in range(30):
        t += rng.choice((0, 0, 1, 2, 3, 5))
        prompt = rng.choice(prefixes)[:] + _toks(rng, rng.randrange(0, 30))
        salt = rng.choice((None, None, None, "s1", "s2"))
        lora = rng.choice((None, None, None, "ad-1", "ad-2"))
        s.requests.append(Req(f"q{i}", t, prompt, rng.randrange(1, 20), salt, lora))
    return s


# ---------------------------------------------------------------------------------------------- vLLM
def _write_model_config(d: str) -> None:
    """A config.json of a tiny Llama: the scheduler reads lengths from it; no weights exist or load."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-5,
    }
    Path(d, "config.json").write_text(json.dumps(cfg))


def run(sc: Scenario, model_dir: str) -> dict[str, Any]:
    import msgspec
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_events import EventPublisher, KVEventBatch
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    published: list[KVEventBatch] = []

    class Recorder(EventPublisher):
        """Keeps each batch the scheduler publishes, in place of the ZeroMQ publisher (same ABC; like
        ``ZmqEventPublisher.publish`` it fills in the rank)."""

        def __init__(self, data_parallel_rank: int = 0, **_: Any) -> None:
            super().__init__(data_parallel_rank)

        def publish(self, events: Any) -> None:
            if events.data_parallel_rank is None:
                events.data_parallel_rank = self._data_parallel_rank
            published.append(events)

        def shutdown(self) -> None:
            pass

    bs = sc.block_size
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
        lora_config=LoRAConfig(max_loras=sc.max_loras, max_lora_rank=8) if sc.max_loras else None,
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = sc.num_blocks
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kvc = KVCacheConfig(
        num_blocks=sc.num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)]
    )
    sched = Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=bs, log_stats=True)
    sched.kv_event_publisher = Recorder()  # events are queued whenever enable_kv_cache_events is on
    init_none_hash(sha256)
    hasher = get_request_block_hasher(bs, sha256)
    lora_ids: dict[str, int] = {}
    rng = random.Random(f"outputs/{sc.name}")
    outputs: dict[str, list[int]] = {r.rid: [] for r in sc.requests}
    cached: dict[str, int] = {}
    steps: list[dict[str, Any]] = []
    enc = msgspec.msgpack.Encoder()
    pending = sorted(sc.requests, key=lambda r: r.arrival)
    step = 0
    while pending or sched.get_num_unfinished_requests():
        while pending and pending[0].arrival <= step:
            r = pending.pop(0)
            lora = None
            if r.lora is not None:
                lid = lora_ids.setdefault(r.lora, len(lora_ids) + 1)
                lora = LoRARequest(r.lora, lid, f"/adapters/{r.lora}")
            sched.add_request(
                Request(
                    r.rid,
                    list(r.prompt),
                    SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                    None,
                    lora_request=lora,
                    cache_salt=r.cache_salt,
                    block_hasher=hasher,
                )
            )
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            req = sched.requests[rid]
            # num_computed_tokens already includes this step's tokens (advanced in schedule())
            sampled.append([rng.randrange(1, VOCAB)] if req.num_computed_tokens >= req.num_tokens else [])
        res = sched.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
            ),
        )
        for eco in res.values():
            for o in eco.outputs:
                outputs[o.request_id] += list(o.new_token_ids)
                if o.prefill_stats is not None:
                    cached.setdefault(o.request_id, o.prefill_stats.num_cached_tokens)
        batch = published.pop() if published else None
        assert not published, "one batch per step"
        rec: dict[str, Any] = {
            "step": step,
            "scheduled": dict(so.num_scheduled_tokens),
            "preempted": sorted(so.preempted_req_ids or ()),
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
            "block_size": sc.block_size,
            "num_gpu_blocks": sc.num_blocks,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_model_len": sc.max_model_len,
            "max_loras": sc.max_loras,
        },
        "requests": [
            {
                "id": r.rid,
                "arrival": r.arrival,
                "prompt": r.prompt,
                "max_tokens": r.max_tokens,
                "cache_salt": r.cache_salt,
                "lora": r.lora,
                "outputs": outputs[r.rid],
                "num_cached_tokens": cached[r.rid],
            }
            for r in sc.requests
        ],
        "steps": steps,
    }


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _summary(ev: Any) -> str:
    """``S3<`` (stored 3 blocks after a parent), ``S2`` (from the start), ``R`` (removed), ``C`` (cleared):
    a reader's index into the payload, which holds every field."""
    kind = type(ev).__name__
    if kind == "BlockStored":
        return f"S{len(ev.block_hashes)}" + ("<" if ev.parent_block_hash is not None else "")
    return "R" if kind == "BlockRemoved" else "C"


def _dump(obj: dict[str, Any]) -> str:
    lines = []
    for k, v in obj.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            inner = ",\n  ".join(json.dumps(x) for x in v)
            lines.append(f' "{k}": [\n  {inner}\n ]')
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


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
            print(f"vLLM scheduler fixtures out of date: {stale}", file=sys.stderr)
            return 1
        print(f"{len(files)} vLLM scheduler fixtures match a fresh recording")
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for n, t in files.items():
        (OUT / n).write_text(t)
    print(f"wrote {len(files)} scenarios to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
