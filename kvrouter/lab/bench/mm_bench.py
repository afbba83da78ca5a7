"""Multimodal rows of ``kvrouter bench tokenizer``: the router's CPU per media item.

A Qwen2.5-VL-style model directory is written to a temporary directory (the default tokenizer with the
family's special tokens, its processor files; no weights).  Measured per request of one user message with
one image and a line of text, on the same chat body with the image part and with it replaced by nothing:

- ``uuid``: an image named by ``uuid`` whose size the router saw before (no bytes): the part read, the
  name looked up, the placeholders expanded;
- ``data_url_1mp``: a 1-megapixel JPEG (1152 x 864, photo-like noise so it does not compress away) as a
  ``data:`` URL: base64 decoded, header read, bytes hashed (BLAKE3, framed as vLLM frames them), expanded;
- ``text_only``: the same body without the image (the baseline the item's cost is measured against).

``item_us`` is each row's p50 minus the text-only p50.  The expansion of large items runs on the tokenizer
cache's executor in the gateway (``CachedTokenizer.aencode_chat_request``), never on the event loop: the
row ``loop_blocked_us`` times what the event loop itself spends per data-URL request.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tokenizers import AddedToken, Tokenizer

from kvrouter.percentiles import summary_us
from tokenizer_cache import CachedTokenizer, default_tokenizer_path

_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _model_dir(root: Path) -> Path:
    tk = Tokenizer.from_file(str(Path(default_tokenizer_path()) / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    tk.save(str(root / "tokenizer.json"))
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "chat_template": _TEMPLATE,
        },
        "config.json": {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"]},
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor",
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "merge_size": 2,
        },
    }
    for name, value in files.items():
        (root / name).write_text(json.dumps(value), encoding="utf-8")
    return root


def _jpeg_1mp(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    px = rng.integers(0, 256, size=(864, 1152, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(px, "RGB").save(out, "JPEG", quality=85)
    return out.getvalue()


def _time(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_multimodal(samples: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvrouter-mm-bench-") as tmp:
        ct = CachedTokenizer.from_pretrained(str(_model_dir(Path(tmp))), mm_model_id="bench/qwen-vl")
        jpeg = _jpeg_1mp(seed)
        url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
        text = {"type": "text", "text": "What changed on this screen since the last step? " * 4}

        def body(part: dict[str, Any] | None) -> dict[str, Any]:
            content = [part, text] if part is not None else [text]
            return {"messages": [{"role": "user", "content": content}]}

        ct.encode_chat_request(body({"type": "image_url", "image_url": {"url": url}, "uuid": "shot-1"}))
        rows = {
            "text_only": body(None),
            "uuid": body({"type": "image_url", "image_url": None, "uuid": "shot-1"}),
            "data_url_1mp": body({"type": "image_url", "image_url": {"url": url}}),
        }
        for b in rows.values():  # warm: templates compiled, the text cached
            ct.encode_chat_request(b)
        out: dict[str, Any] = {"jpeg_bytes": len(jpeg), "image": "1152x864"}
        times: dict[str, list[float]] = {k: [] for k in rows}
        order = list(rows)
        for _ in range(samples):  # interleaved, so machine noise hits every row alike
            rng.shuffle(order)
            for k in order:
                times[k] += _time(lambda b=rows[k]: ct.encode_chat_request(b), 1)
        for k, t in times.items():
            out[k] = summary_us(t)
        base = out["text_only"]["p50_us"]
        out["item_us"] = {k: round(out[k]["p50_us"] - base, 1) for k in ("uuid", "data_url_1mp")}
        enc = ct.encode_chat_request(rows["data_url_1mp"])
        out["placeholder_tokens"] = enc.mm[0].length if enc.mm else 0
        out["paths"] = dict(ct.multimodal.paths) if ct.multimodal else {}
        out["loop_blocked_us"] = _loop_blocked(ct, rows["data_url_1mp"], samples)
        ct.close()
    out["targets"] = {
        "uuid_item_le_50us": out["item_us"]["uuid"] <= 50,
        "data_url_1mp_item_le_2ms": out["item_us"]["data_url_1mp"] <= 2000,
    }
    return out


def _loop_blocked(ct: CachedTokenizer, body: dict[str, Any], samples: int) -> dict[str, float]:
    """How long the event loop itself is busy per data-URL request (the rest runs on the executor):
    the largest gap between ticks of a 0-second ticker while the request is encoded."""

    async def run() -> list[float]:
        gaps: list[float] = []
        for _ in range(samples):
            done = asyncio.Event()
            worst = [0.0]
            t = asyncio.create_task(_ticker(done, worst))
            await asyncio.sleep(0)
            await ct.aencode_chat_request(body)
            done.set()
            await t
            gaps.append(worst[0])
        return gaps

    return summary_us(asyncio.run(run()))


async def _ticker(done: asyncio.Event, worst: list[float]) -> None:
    last = time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(0)
        now = time.perf_counter()
        worst[0] = max(worst[0], now - last)
        last = now
