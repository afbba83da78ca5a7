"""How long a simulated engine step takes: a roofline over what the step actually computed::

    t = step_overhead + num_scheduled * per_seq_overhead
        + max( compute: ((prefill + decode tokens) * 2·params + attention_pairs * attn_flops)
                        / (num_gpus * peak_flops * mfu),
               memory:  (weights + context_tokens * kv_bytes_per_token) / (num_gpus * hbm_bandwidth * mbu) )
        + (loaded_tokens / cpu_load_bw + shared_loaded_tokens / shared_load_bw) * kv_bytes_per_token,
    divided by ``speed``

Prefix-cache hits cost nothing (never computed).  ``mfu`` and ``mbu`` are the only fitted constants,
calibrated on published serving figures cited per profile; the rest is architecture and datasheet
arithmetic.  KV capacity follows vLLM's rule: ``gpu_memory_utilization`` of each GPU's memory, minus its
weight shard and non-KV reservations, divided by one token's KV bytes.  Outside the steps each request
pays vLLM's API server (``FrontendCosts``, applied by ``frontend.FrontEnd``): HTTP, rendering and
tokenization, the hop to the engine core, the first token's detokenization and streaming.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvrouter.lab.sim.engine.scheduler import BatchStats
from kvrouter.lab.sim.errors import SimConfigError, UnknownProfile

# NVIDIA H100 SXM5 datasheet: 989.4 TFLOPS dense BF16 (1978.9 FP8), 3.35 TB/s HBM3, 80 GB
# (81,559 MiB = 85.5e9 bytes as CUDA reports it).  Non-KV reservations per GPU (activations of vLLM's
# profiling run, CUDA graphs, NCCL buffers) are assumed 5 GB (``reserved_bytes_per_gpu``).
H100_BF16_FLOPS = 989.4e12
H100_HBM_BYTES_PER_S = 3.35e12
H100_MEM_BYTES = 85.5e9
PCIE5_X16_BYTES_PER_S = 50e9  # ~64 GB/s theoretical per direction, ~50 achieved for pinned host copies


PromptApi = Literal["chat", "completion", "token_ids"]
"""How a request's prompt reaches vLLM: chat messages (template + tokenization), completion text
(tokenization), or completion token ids (validated only)."""
PROMPT_APIS: tuple[PromptApi, ...] = ("chat", "completion", "token_ids")


class LinearCost(msgspec.Struct, frozen=True):
    """``fixed_s + per_token_s x prompt tokens``."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0

    def at(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


class FrontendCosts(msgspec.Struct, frozen=True):
    """What one request costs vLLM's API server and the hops around the engine, in seconds; every part
    but ``render`` is latency (other requests are not held up by it), ``render`` runs on the renderer's
    worker threads, one request at a time each, in arrival order."""

    http_request_s: float = 0.0
    """Client to handler: HTTP, body read, request validation (before the renderer)."""
    render_chat: LinearCost = LinearCost()
    """Chat template + tokenization of the rendered text (``OnlineRenderer.render_chat``)."""
    render_completion: LinearCost = LinearCost()
    """Tokenization of a completion prompt (``OnlineRenderer.render_completion``)."""
    render_token_ids: LinearCost = LinearCost()
    """A completion prompt sent as token ids: its validation, nothing to tokenize."""
    renderer_workers: int = 1
    """vLLM's ``--renderer-num-workers`` (default 1: requests are rendered one after the other)."""
    to_engine: LinearCost = LinearCost()
    """Input processing, msgpack, ZeroMQ to the engine core, its ``Request`` with the block hashes."""
    first_output: LinearCost = LinearCost()
    """ZeroMQ back and the first token's output processing (its detokenizer decodes the whole prompt
    first), then its streamed chunk to the client."""
    next_output_s: float = 0.0
    """The same for every later output (no prompt to decode)."""
    http_response_s: float = 0.0
    """One streamed chunk from the handler to the client (counted in every output's way back)."""

    def validate(self) -> None:
        if self.renderer_workers < 1:
            raise SimConfigError("renderer_workers must be >= 1")
        costs = (self.render_chat, self.render_completion, self.render_token_ids, self.to_engine)
        for c in (*costs, self.first_output):
            if c.fixed_s < 0 or c.per_token_s < 0:
                raise SimConfigError("front-end costs must be >= 0")
        if min(self.http_request_s, self.http_response_s, self.next_output_s) < 0:
            raise SimConfigError("front-end costs must be >= 0")

    def render_s(self, api: PromptApi, tokens: int) -> float:
        """Renderer time of one request (on one worker)."""
        cost = {
            "chat": self.render_chat,
            "completion": self.render_completion,
            "token_ids": self.render_token_ids,
        }[api]
        return cost.at(tokens)

    def first_output_s(self, tokens: int) -> float:
        """Engine output to the client's first streamed token."""
        return self.first_output.at(tokens) + self.http_response_s

    def output_s(self) -> float:
        """Engine output to the client, for every output after the first."""
        return self.next_output_s + self.http_response_s


# vLLM 0.33's API server, per request: CPU-time medians of vLLM's own code fitted a + b x tokens, and an
# estimate of HTTP both ways (tools/frontend_costs.py, raw runs in tools/frontend_costs.json; the runs, the
# fits and the HTTP estimate's bounds: docs/measurements.md, "vLLM's API server, per request").
# --renderer-num-workers defaults to 1 (vllm/config/model.py), so renders queue.  The first token comes
# from the prefill step itself (vLLM's benchmark client takes TTFT at the first chunk with content, which
# carries it): no decode step is on its way.  Why a queue: vLLM's v0.6.0 performance post
# (blog.vllm.ai/2024/09/05/perf-update.html) found the HTTP API server taking a third of serving time, and
# vLLM PR #17546 added --api-server-count because one API server limits TTFT at high request rates.  Not
# modelled: the event loop also detokenizes and streams every running request's token each step, which
# slows this path at large batches (the costs are an idle API server's).
VLLM_033_FRONTEND = FrontendCosts(
    http_request_s=0.00075,
    render_chat=LinearCost(0.00069, 2.33e-6),
    render_completion=LinearCost(0.00025, 2.15e-6),
    render_token_ids=LinearCost(0.00011, 0.09e-6),
    renderer_workers=1,
    to_engine=LinearCost(0.00018, 0.22e-6),
    first_output=LinearCost(0.00002, 0.54e-6),
    next_output_s=0.00004,
    http_response_s=0.00075,
)
NO_FRONTEND = FrontendCosts()
"""Requests reach the engine at once and outputs leave at once (the ``test`` profile; ablations)."""


class TimingProfile(msgspec.Struct, frozen=True):
    """A model on a GPU setup, described by what decides step time and KV capacity."""

    name: str
    """Registry key, e.g. ``llama-3.1-70b-8xh100``."""
    description: str
    """Model, GPUs, parallelism, dtype, and the sources of the calibration."""
    num_gpus: int
    """GPUs of one instance (tensor parallel size)."""
    weight_bytes: float
    """All weights, bytes (params x 2 for BF16)."""
    flops_per_token: float
    """Linear-layer FLOPs per token, 2 x params."""
    attn_flops_per_pair: float
    """Attention FLOPs per (query, context token) pair: 4 x layers x query heads x head dim."""
    kv_bytes_per_token: int
    """KV bytes per token, all GPUs: 2 (K,V) x layers x KV heads x head dim x 2 bytes."""
    peak_flops: float = H100_BF16_FLOPS
    """Dense peak per GPU for the weights' dtype."""
    hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S
    """Memory bandwidth per GPU."""
    mfu: float = 0.4
    """Achieved fraction of peak FLOPs in prefill (fitted)."""
    mbu: float = 0.5
    """Achieved fraction of HBM bandwidth in decode, collectives included (fitted)."""
    step_overhead_s: float = 0.002
    """Per-step CPU work: scheduling, input preparation, launch (assumed 2 ms for vLLM v1)."""
    per_seq_overhead_s: float = 0.00005
    """Per scheduled request: sampling, detokenisation, output processing (assumed 50 us)."""
    cpu_load_bytes_per_s: float = PCIE5_X16_BYTES_PER_S
    """Host-to-GPU bandwidth for CPU-tier loads, per instance."""
    gpu_mem_bytes: float = H100_MEM_BYTES
    """Memory per GPU."""
    gpu_memory_utilization: float = 0.9
    """vLLM's ``--gpu-memory-utilization`` default."""
    reserved_bytes_per_gpu: float = 5e9
    """Non-KV, non-weight memory per GPU (assumed)."""
    max_context: int = 131072
    """The model's context window (an upper bound for ``max_model_len``)."""
    kv_capacity_blocks_override: int | None = None
    """Fixed KV capacity in blocks (the ``test`` profile); None: derived from memory as above."""
    frontend: FrontendCosts = VLLM_033_FRONTEND
    """vLLM's API server around the engine, per request (the same CPU work whatever the GPUs)."""
    encoder_flops_per_token: float = 0.0
    """Vision encoder FLOPs per placeholder token (one embedding) of a multimodal item; 0: a text model.
    Run at the same achieved FLOP rate as prefill, before the step's forward pass."""

    def validate(self) -> None:
        if self.num_gpus < 1:
            raise SimConfigError(f"{self.name}: num_gpus must be >= 1")
        for field in ("weight_bytes", "flops_per_token", "peak_flops", "hbm_bytes_per_s", "mfu", "mbu"):
            if getattr(self, field) <= 0:
                raise SimConfigError(f"{self.name}: {field} must be positive")
        if self.mfu > 1 or self.mbu > 1:
            raise SimConfigError(f"{self.name}: mfu and mbu are fractions of peak")
        if self.kv_capacity_blocks(16) < 1:
            raise SimConfigError(f"{self.name}: no memory left for the KV cache")
        self.frontend.validate()

    def kv_capacity_blocks(self, block_size: int) -> int:
        """KV blocks that fit: per GPU, (util x memory - weight shard - reserved) / KV bytes per token."""
        if self.kv_capacity_blocks_override is not None:
            return self.kv_capacity_blocks_override
        per_gpu = self.gpu_mem_bytes * self.gpu_memory_utilization
        per_gpu -= self.weight_bytes / self.num_gpus + self.reserved_bytes_per_gpu
        tokens = per_gpu / (self.kv_bytes_per_token / self.num_gpus)
        return max(0, int(tokens) // block_size)


# Llama-3.1-70B: 80 layers, hidden 8192, 64 query and 8 KV heads of dim 128, 70.6e9 params (config.json).
#   KV/token = 2 x 80 x 8 x 128 x 2 B = 327,680 B;  attention = 4 x 80 x 8192 = 2.62 MFLOP per pair.
#   Capacity on 8 x H100, TP8, BF16: 0.9 x 85.5e9 - 141.2e9/8 - 5e9 = 54.3e9 B per GPU; 40,960 B of KV per
#   token per GPU -> 1.33M tokens -> 82,870 blocks of 16.
# Calibration:
#   mbu 0.49: decode at low batch ~13 ms per token.  vLLM, Llama-3-70B, 8 x H100 SXM, TP8, BF16: median TPOT
#     12.8 ms with 10 concurrent ShareGPT prompts (LambdaLabsML/vllm-benchmark,
#     results/prompt_10/8xH100-80GB-SXM/Meta-Llama-3-70B-Instruct_tp8_len8192.json, 2024-09); NVIDIA's
#     published NIM table for Llama-3.1-70B-Instruct (v1.3.0) shows ITL 13.21 ms at concurrency 1 and
#     23.28 ms at 100 (docs.nvidia.com/nim/benchmarking/llm, "Performance").  13 ms - 2 ms overhead = 141.2 GB
#     streamed in 10.8 ms over 8 GPUs.
#   mfu 0.40: prefill ~22k tokens/s.  NIM Llama-3.3-70B (same architecture), 2 x H100 FP8 TP2: TTFT 406.77 ms
#     for a 5000-token prompt at concurrency 1 (same page) = 12.3k tokens/s = 0.44 of FP8 peak; TP8 pays more
#     all-reduce per FLOP, hence 0.40 (an 8k-token prompt alone: ~0.4 s to first token).
LLAMA_31_70B_8XH100 = TimingProfile(
    name="llama-3.1-70b-8xh100",
    description="Llama-3.1-70B-Instruct, BF16, 8 x H100 SXM, TP8 (vLLM); calibrated on Lambda's vLLM "
    "benchmark (TPOT 12.8 ms) and NVIDIA NIM figures (ITL 13.2 ms at c=1; 12.3k prompt tok/s on 2xH100 FP8)",
    num_gpus=8,
    weight_bytes=141.2e9,
    flops_per_token=141.2e9,
    attn_flops_per_pair=2.62e6,
    kv_bytes_per_token=327_680,
    mfu=0.40,
    mbu=0.49,
    max_context=131072,
)

# Qwen3-32B: 64 layers, hidden 5120, 64 query heads and 8 KV heads of dim 128, 32.8e9 params (config.json).
#   KV/token = 2 x 64 x 8 x 128 x 2 B = 262,144 B;  attention = 4 x 64 x 8192 = 2.10 MFLOP per pair.
#   Capacity on 2 x H100, TP2, BF16: 0.9 x 85.5e9 - 65.6e9/2 - 5e9 = 39.2e9 B per GPU; 131,072 B of KV per
#   token per GPU -> 299k tokens -> 18,670 blocks of 16.  Context: 40,960 (config max_position_embeddings).
# Calibration (no published vLLM Qwen3-32B TP2 latency table was found; the nearest TP2 H100 figures are
# NIM's Llama-3.3-70B FP8 TP2, which streams about the same bytes per step, 70.6 GB vs 65.6 GB):
#   mbu 0.64: ITL 18.58 ms at concurrency 1 -> 70.6 GB in 16.5 ms over 2 GPUs (TP2 has fewer collectives
#     than TP8); Qwen3-32B BF16 then decodes at ~17.4 ms per token.
#   mfu 0.44: the same table's 12.3k prompt tokens/s -> ~13k prompt tokens/s for Qwen3-32B BF16 on 2 GPUs.
QWEN3_32B_2XH100 = TimingProfile(
    name="qwen3-32b-2xh100",
    description="Qwen3-32B, BF16, 2 x H100 SXM, TP2 (vLLM); calibrated on NVIDIA NIM TP2 H100 figures "
    "(ITL 18.6 ms at c=1, 12.3k prompt tokens/s for a 70.6 GB model) scaled to 65.6 GB of weights",
    num_gpus=2,
    weight_bytes=65.6e9,
    flops_per_token=65.6e9,
    attn_flops_per_pair=2.10e6,
    kv_bytes_per_token=262_144,
    mfu=0.44,
    mbu=0.64,
    max_context=40960,
)

# Qwen2.5-VL-72B-Instruct: its language model is Qwen2.5-72B (80 layers, hidden 8192, 64 query and 8 KV
# heads of dim 128: Llama-3.1-70B's attention shape and KV size), 72.7e9 params with the vision tower.
#   Vision encoder (config.json vision_config): 32 blocks, hidden 1280, SwiGLU MLP 3420, ~0.63e9 params in
#   the blocks; each placeholder token merges 2 x 2 patches of 14 px, so one embedding is 4 patch tokens
#   through the blocks, 4 x 2 x 0.63e9 = 5.0e9 FLOPs; attention: 28 windowed layers (112 px: 64 patches)
#   and 4 full ones (a 1280 x 720 screenshot: ~4800 patches), 4 x 1280 x (28 x 64 + 4 x 4800) x 4 = 0.4e9;
#   the merger MLP 2 x (5120 x 5120 + 5120 x 8192) = 0.14e9: ~5.6e9 FLOPs per placeholder token.  The
#   tower runs on the instance's GPUs at prefill's MFU (vLLM shards it with the model's tensor
#   parallelism by default).  Decode and prefill calibration: Llama's.
QWEN25_VL_72B_8XH100 = msgspec.structs.replace(
    LLAMA_31_70B_8XH100,
    name="qwen2.5-vl-72b-8xh100",
    description="Qwen2.5-VL-72B-Instruct, BF16, 8 x H100 SXM, TP8 (vLLM): Llama-3.1-70B's calibration "
    "(same attention shape) with 72.7e9 params and a 0.67e9-param vision tower at 5.6 GFLOP per image token",
    weight_bytes=145.4e9,
    flops_per_token=145.4e9,
    encoder_flops_per_token=5.6e9,
)

# A tiny, fast pseudo-model for tests and demos on a laptop: ~1 ms per decode step, ~0.5M prompt tokens/s,
# 4096 blocks (65k tokens) of KV, no front-end cost.
TEST = TimingProfile(
    name="test",
    description="tiny pseudo-model: 1 ms decode steps, 0.5M prompt tokens/s, 4096 KV blocks, no front end",
    num_gpus=1,
    weight_bytes=0.5e9,
    flops_per_token=2e9,
    attn_flops_per_pair=1e3,
    kv_bytes_per_token=1024,
    peak_flops=1e15,
    hbm_bytes_per_s=1e12,
    mfu=1.0,
    mbu=1.0,
    step_overhead_s=0.0005,
    per_seq_overhead_s=0.000005,
    max_context=32768,
    kv_capacity_blocks_override=4096,
    frontend=NO_FRONTEND,
)


class Gpu(msgspec.Struct, frozen=True):
    """One GPU's datasheet figures, what a profile's roofline reads of the hardware."""

    name: str
    bf16_flops: float
    """Dense BF16 peak."""
    hbm_bytes_per_s: float
    mem_bytes: float
    """Memory as CUDA reports it."""


H100_SXM = Gpu("h100", H100_BF16_FLOPS, H100_HBM_BYTES_PER_S, H100_MEM_BYTES)
# NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS dense BF16, 2,039 GB/s HBM2e, 80 GB (81,920 MiB = 85.9e9 bytes).
A100_SXM_80GB = Gpu("a100", 312e12, 2.039e12, 85.9e9)


def on_gpus(base: TimingProfile, gpu: Gpu, num_gpus: int) -> TimingProfile:
    """``base``'s model on ``num_gpus`` x ``gpu`` with tensor parallelism: the same architecture figures,
    the GPU's datasheet peak, bandwidth and memory, and ``base``'s fitted fractions of peak (``mfu``,
    ``mbu``: an assumption, no serving figure of these setups was calibrated; the step overheads and the API
    server are the same vLLM).  Named ``<model>-<n>x<gpu>`` as the calibrated profiles are."""
    model = base.name.rsplit("-", 1)[0]
    return msgspec.structs.replace(
        base,
        name=f"{model}-{num_gpus}x{gpu.name}",
        description=f"{base.description.split(',')[0]}, BF16, {num_gpus} x {gpu.name.upper()}, TP{num_gpus} "
        f"(derived from {base.name}: datasheet peak, bandwidth and memory, its fitted mfu and mbu)",
        num_gpus=num_gpus,
        peak_flops=gpu.bf16_flops,
        hbm_bytes_per_s=gpu.hbm_bytes_per_s,
        gpu_mem_bytes=gpu.mem_bytes,
    )


TEST_SLOW = msgspec.structs.replace(
    TEST,
    name="test-slow",
    description="the test pseudo-model on a slower GPU: a third of its FLOPs, 0.6 of its bandwidth",
    peak_flops=TEST.peak_flops / 3,
    hbm_bytes_per_s=TEST.hbm_bytes_per_s * 0.6,
)
"""For live tests of mixed fleets: ``test``'s ratios of an A100 to an H100."""

# Mixed fleets (``kvrouter eval --profiles``, ``kvrouter sim --profiles``): older GPUs and other
# tensor-parallel sizes of the same two models.  On A100s a 70B prefill runs at about a third of the H100
# rate (312 vs 989 TFLOPS) and decodes at about 0.6x (2.0 vs 3.35 TB/s); TP1 and TP4 halve or double a
# TP2/TP8 instance's throughput and change its KV capacity (the weight shard per GPU).
DERIVED = (
    on_gpus(LLAMA_31_70B_8XH100, A100_SXM_80GB, 8),
    on_gpus(LLAMA_31_70B_8XH100, H100_SXM, 4),
    on_gpus(QWEN3_32B_2XH100, A100_SXM_80GB, 2),
    on_gpus(QWEN3_32B_2XH100, H100_SXM, 1),
    on_gpus(QWEN3_32B_2XH100, H100_SXM, 4),
)

PROFILES: dict[str, TimingProfile] = {
    p.name: p
    for p in (LLAMA_31_70B_8XH100, QWEN3_32B_2XH100, QWEN25_VL_72B_8XH100, TEST, TEST_SLOW, *DERIVED)
}


def parse_profiles(spec: str) -> list[str]:
    """``a*2,b*2`` (or ``a,a,b,b``) -> each instance's profile name, in order; ``UnknownProfile`` for a name
    not in ``PROFILES``, ``SimConfigError`` for a bad count."""
    out: list[str] = []
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        name, _, count = part.partition("*")
        get_profile(name)
        try:
            n = int(count) if count else 1
        except ValueError:
            raise SimConfigError(f"profiles {spec!r}: {count!r} is not a count") from None
        if n < 1:
            raise SimConfigError(f"profiles {spec!r}: counts must be >= 1")
        out += [name] * n
    if not out:
        raise SimConfigError(f"profiles {spec!r}: no instance")
    return out


def get_profile(name: str) -> TimingProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownProfile(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None


class TimingModel:
    """Step durations for one profile; ``speed`` > 1 runs faster than real time (durations / speed)."""

    def __init__(
        self, profile: TimingProfile, speed: float = 1.0, *, shared_load_bytes_per_s: float = 12.5e9
    ) -> None:
        """``shared_load_bytes_per_s``: the bandwidth of loads from a shared store (``shared_store``)."""
        if speed <= 0 or shared_load_bytes_per_s <= 0:
            raise SimConfigError("speed and shared_load_bytes_per_s must be positive")
        self.shared_load_bytes_per_s = shared_load_bytes_per_s
        profile.validate()
        self.profile = profile
        self.speed = speed
        p = profile
        self._flops = p.num_gpus * p.peak_flops * p.mfu
        self._bw = p.num_gpus * p.hbm_bytes_per_s * p.mbu

    def step_time(self, stats: BatchStats) -> float:
        """Modelled duration of a step that computed ``stats`` (0 when nothing ran), in seconds.  Loads
        are charged in the step that queued them, also when it computed nothing else."""
        p = self.profile
        t = 0.0
        if stats.num_scheduled:
            compute = (
                (stats.prefill_tokens + stats.decode_tokens) * p.flops_per_token
                + stats.attention_pairs * p.attn_flops_per_pair
            ) / self._flops
            memory = (p.weight_bytes + stats.context_tokens * p.kv_bytes_per_token) / self._bw
            t = p.step_overhead_s + stats.num_scheduled * p.per_seq_overhead_s + max(compute, memory)
        if stats.encoder_tokens:
            t += stats.encoder_tokens * p.encoder_flops_per_token / self._flops
        if stats.loaded_tokens:
            t += stats.loaded_tokens * p.kv_bytes_per_token / p.cpu_load_bytes_per_s
        if stats.shared_loaded_tokens:
            t += stats.shared_loaded_tokens * p.kv_bytes_per_token / self.shared_load_bytes_per_s
        return t / self.speed

    def decode_run_time(self, batch: int, base_context: int, k: int) -> float:
        """The summed ``step_time`` of ``k`` decode-only steps of ``batch`` requests, step ``j`` holding
        ``base_context + j * batch`` context tokens: the same arithmetic per step, without building the
        k ``BatchStats`` (the evaluator's coalesced decode phases call this millions of times)."""
        if batch == 0 or k <= 0:
            return 0.0
        p = self.profile
        flops, bw, speed = self._flops, self._bw, self.speed
        fixed = p.step_overhead_s + batch * p.per_seq_overhead_s
        tok_flops = batch * p.flops_per_token
        afp, kvb, weights = p.attn_flops_per_pair, p.kv_bytes_per_token, p.weight_bytes
        # sum() of the list, as the per-step version summed (Python >= 3.12 sums floats compensated).
        return sum(
            [
                (fixed + max((tok_flops + ctx * afp) / flops, (weights + ctx * kvb) / bw)) / speed
                for ctx in range(base_context, base_context + k * batch, batch)
            ]
        )
