"""Media the router cannot or need not decode: names, URLs, other modalities, oversized and broken bytes.

vLLM's own answers for these shapes are in the recorded fixtures (test_mm_parity.py); here the router's
side: what it routes exactly, what it routes on the exact prefix before an item, what it refuses and what
it leaves to vLLM, and that a prefix cut before an item is a prefix of the full prompt's ids.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tokenizer_cache import CachedTokenizer
from tokenizer_cache.errors import ChatTemplateError, UnsupportedContentError
from tokenizer_cache.mm.items import MediaError

from ..support.mm_models import build_mm_model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> CachedTokenizer:
    d = build_mm_model("qwen2_5_vl", tmp_path_factory.mktemp("mm") / "qwen2_5_vl")
    return CachedTokenizer.from_pretrained(str(d), mm_model_id="test/qwen")


def _png(w: int, h: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), (10, 20, 30)).save(out, "PNG")
    return out.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header_only(w: int, h: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IEND", b"")


def _body(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look at this."}, *parts]}]}


def test_a_name_seen_with_its_bytes_routes_exactly_later(qwen: CachedTokenizer) -> None:
    data = _png(300, 200)
    named = {"type": "image_url", "image_url": None, "uuid": "shot-7"}
    before = qwen.encode_chat_request(_body(named))
    assert not before.complete and before.media_paths == ("prefix_only",)
    full = qwen.encode_chat_request(
        _body({"type": "image_url", "image_url": {"url": _url(data)}, "uuid": "shot-7"})
    )
    assert full.complete and [i.identifier for i in full.mm] == ["shot-7"]
    after = qwen.encode_chat_request(_body(named))
    assert after.complete and after.media_paths == ("uuid_cached",)
    assert after.tokens == full.tokens and after.mm == full.mm
    assert full.tokens[: len(before.tokens)] == before.tokens  # the cut prompt was a prefix


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}, "uuid": "never-seen"},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    ],
)
def test_items_it_cannot_size_end_the_exact_prefix(qwen: CachedTokenizer, part: dict[str, Any]) -> None:
    first = {"type": "image_url", "image_url": {"url": _url(_png(100, 100))}}
    got = qwen.encode_chat_request(_body(first, part))
    assert not got.complete and got.media_paths[1] == "prefix_only" and len(got.mm) == 1
    whole = qwen.encode_chat_request(
        _body(first, {"type": "image_url", "image_url": {"url": _url(_png(64, 64))}})
    )
    assert whole.tokens[: len(got.tokens)] == got.tokens and len(got.tokens) < len(whole.tokens)


def test_broken_media_is_refused_as_vllm_refuses_it(qwen: CachedTokenizer) -> None:
    for url in ("data:image/png;base64,@@@@", _url(b"not an image at all"), "data:image/png;base64"):
        with pytest.raises(MediaError):
            qwen.encode_chat_request(_body({"type": "image_url", "image_url": {"url": url}}))
    with pytest.raises(MediaError):  # aspect ratio above 200: Qwen-VL's processor refuses it
        qwen.encode_chat_request(_body({"type": "image_url", "image_url": {"url": _url(_png(402, 2))}}))


def test_left_to_vllm_with_a_reason(qwen: CachedTokenizer) -> None:
    cases = {
        "media_not_base64": "data:image/png,abcd",
        "media_too_large": _url(_png_header_only(40000, 40000)),  # a header alone: never decoded
    }
    for reason, url in cases.items():
        with pytest.raises(UnsupportedContentError) as e:
            qwen.encode_chat_request(_body({"type": "image_url", "image_url": {"url": url}}))
        assert e.value.reason == reason
        assert not isinstance(e.value, MediaError) and isinstance(e.value, ChatTemplateError)


def test_embeddings_and_other_modalities_are_not_reproduced(qwen: CachedTokenizer) -> None:
    for part in (
        {"type": "image_embeds", "image_embeds": "AAAA"},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},  # not a Qwen-VL modality
    ):
        with pytest.raises(UnsupportedContentError):
            qwen.encode_chat_request(_body(part))


async def test_event_loop_path_agrees(qwen: CachedTokenizer) -> None:
    body = _body({"type": "image_url", "image_url": {"url": _url(_png(333, 222))}})
    sync = qwen.encode_chat_request(body)
    got = await qwen.aencode_chat_request(body)
    assert got.tokens == sync.tokens and got.mm == sync.mm and got.complete


def test_uuid_only_model_without_size(tmp_path: Path) -> None:
    """Gemma 3 without pan-and-scan: every image expands alike, so a name alone routes exactly."""
    d = build_mm_model("gemma3_mm", tmp_path / "gemma3_mm")
    tok = CachedTokenizer.from_pretrained(str(d), mm_model_id="test/gemma")
    got = tok.encode_chat_request(_body({"type": "image_url", "image_url": None, "uuid": "logo"}))
    assert got.complete and got.media_paths == ("uuid",) and [i.identifier for i in got.mm] == ["logo"]
