"""The multimodal parity corpus: chat, Responses and Messages bodies with images, built from a seed.

Images are made here with Pillow (solid colours and stripes: small files at any size) in the formats and
modes clients send: PNG (RGB, RGBA, palette with transparency, greyscale), JPEG (RGB, greyscale, CMYK, an
EXIF orientation that swaps the sides), GIF, WebP (with and without alpha), BMP; sizes from 1x1 to 4000 px
and aspect ratios up to 1:300.  Bodies put several images in one message, images in tool results, images
with ``uuid``, cache salts, and broken media (bad base64, bytes that are no image, a data URL that is not
base64) whose refusal vLLM decides.  The bodies are stored in the fixture, so the tests never rebuild them.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from typing import Any

from PIL import Image

__all__ = ["MMCase", "build_mm_corpus"]


@dataclass(frozen=True)
class MMCase:
    id: str
    route: str
    """chat, responses or messages."""
    body: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "route": self.route, "body": self.body}


_FORMATS = (
    ("PNG", "RGB"),
    ("PNG", "RGBA"),
    ("PNG", "P"),
    ("PNG", "L"),
    ("JPEG", "RGB"),
    ("JPEG", "L"),
    ("JPEG", "CMYK"),
    ("GIF", "P"),
    ("WEBP", "RGB"),
    ("WEBP", "RGBA"),
    ("BMP", "RGB"),
)
_SIZES = (
    (1, 1), (28, 28), (56, 56), (300, 200), (200, 300), (640, 480), (480, 640), (1024, 1024), (1000, 250),
    (250, 1000), (1920, 1080), (1080, 1920), (4000, 3000), (3000, 100), (100, 3000), (900, 3), (3, 900),
    (733, 411), (411, 733), (129, 2049), (512, 77), (60, 59), (300, 1), (1, 200),
)  # fmt: skip


def _image(rng: random.Random, w: int, h: int, fmt: str, mode: str, orientation: int = 0) -> bytes:
    colour = tuple(rng.randrange(256) for _ in range(4))
    base = Image.new("RGBA", (w, h), colour)  # type: ignore[arg-type]
    if w > 4 and h > 4:
        stripe = Image.new("RGBA", (max(1, w // 4), h), tuple(255 - c for c in colour))  # type: ignore[arg-type]
        base.paste(stripe, (w // 3, 0))
    if mode == "RGBA":
        im: Image.Image = base
    elif mode == "P":
        im = base.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
        if fmt in ("PNG", "GIF"):
            im.info["transparency"] = 0
    else:
        im = base.convert(mode)
    out = io.BytesIO()
    kwargs: dict[str, Any] = {}
    if fmt == "JPEG":
        kwargs["quality"] = 80
        if orientation:
            exif = Image.Exif()
            exif[0x0112] = orientation
            kwargs["exif"] = exif.tobytes()
    if mode == "P" and "transparency" in im.info:
        kwargs["transparency"] = 0
    im.save(out, fmt, **kwargs)
    return out.getvalue()


def _url(data: bytes, fmt: str) -> str:
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"


def build_mm_corpus(seed: int) -> list[MMCase]:
    rng = random.Random(seed)
    cases: list[MMCase] = []

    def img(w: int, h: int, fmt: str = "PNG", mode: str = "RGB", orientation: int = 0) -> str:
        return _url(_image(rng, w, h, fmt, mode, orientation), fmt)

    def part(url: str, uuid: str | None = None) -> dict[str, Any]:
        p: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
        if uuid is not None:
            p["uuid"] = uuid
        return p

    def chat(cid: str, messages: list[dict[str, Any]], **extra: Any) -> None:
        cases.append(MMCase(cid, "chat", {"messages": messages, **extra}))

    # One image per request: every format and mode, every size.
    for fmt, mode in _FORMATS:
        for w, h in _SIZES:
            if fmt == "JPEG" and mode == "CMYK" and (w, h) not in ((300, 200), (1024, 1024), (60, 59)):
                continue
            if (fmt == "GIF" and w * h > 2_000_000) or (fmt == "BMP" and w * h > 100_000):
                continue  # GIF's encoder is slow on large frames; BMP is uncompressed
            u = img(w, h, fmt, mode)
            chat(
                f"one-{fmt}-{mode}-{w}x{h}",
                [{"role": "user", "content": [part(u), {"type": "text", "text": "What is this?"}]}],
            )
    for o in (1, 3, 5, 6, 8):
        chat(f"exif-{o}", [{"role": "user", "content": [part(img(640, 200, "JPEG", "RGB", o)), "Describe."]}])
    # Several images per message, text around and between them.
    for n in range(12):
        k = rng.randint(2, 5)
        content: list[Any] = []
        for j in range(k):
            w, h = rng.choice(_SIZES)
            fmt, mode = rng.choice(_FORMATS[:6])
            if rng.random() < 0.5:
                content.append({"type": "text", "text": f"Image {j}: " + "x" * rng.randint(0, 40)})
            content.append(part(img(w, h, fmt, mode)))
        if rng.random() < 0.5:
            content.append({"type": "text", "text": "Compare them.\n"})
        salt = {"cache_salt": f"tenant-{n}"} if n % 3 == 0 else {}
        chat(
            f"multi-{n}",
            [{"role": "system", "content": "You see images."}, {"role": "user", "content": content}],
            **salt,
        )
    # An agent loop: screenshots resent every turn, some with uuids, images in tool results.
    shots = [img(1280, 800, "PNG", "RGB"), img(1280, 800, "JPEG", "RGB"), img(390, 844, "PNG", "RGBA")]
    tools = [{"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object"}}}]
    history: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Open the app."}, part(shots[0], "shot-0")]}
    ]
    for t in range(4):
        history = [
            *history,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": f"c{t}", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
                ],
            },
            {
                "role": "tool",
                "tool_call_id": f"c{t}",
                "content": [
                    {"type": "text", "text": f"step {t}"},
                    part(shots[(t + 1) % 3], f"shot-{t + 1}" if t % 2 else None),
                ],
            },
        ]
        chat(f"agent-{t}", history, tools=tools)
        history = [
            *history,
            {"role": "assistant", "content": f"Done step {t}."},
            {"role": "user", "content": [part(shots[t % 3]), "Next."]},
        ]
        chat(f"agent-user-{t}", history)
    # uuid without bytes (vLLM keeps the item by name), and a data URL with a uuid.
    chat(
        "uuid-only",
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": None, "uuid": "named-1"}, "Again."],
            }
        ],
    )
    chat("uuid-and-data", [{"role": "user", "content": [part(shots[2], "named-2"), "Once."]}])
    # Broken media: vLLM's answer is the fixture.
    chat("bad-base64", [{"role": "user", "content": [part("data:image/png;base64,iVBORw0KGgo!!!!"), "x"]}])
    chat("not-an-image", [{"role": "user", "content": [part(_url(b"hello, world" * 10, "PNG")), "x"]}])
    chat("not-base64", [{"role": "user", "content": [part("data:image/png,abcd"), "x"]}])
    chat("no-comma", [{"role": "user", "content": [part("data:image/png;base64"), "x"]}])
    chat(
        "truncated-png",
        [{"role": "user", "content": [part(_url(_image(rng, 64, 64, "PNG", "RGB")[:40], "PNG")), "x"]}],
    )
    chat("ratio-300", [{"role": "user", "content": [part(img(300, 1)), "thin"]}])
    chat("ratio-201", [{"role": "user", "content": [part(img(201 * 3, 3)), "thin"]}])

    # Responses: input_image parts (a string URL, detail optional), several per message.
    for n in range(8):
        parts: list[Any] = [{"type": "input_text", "text": f"Look {n}."}]
        for _ in range(rng.randint(1, 3)):
            w, h = rng.choice(_SIZES[:14])
            p: dict[str, Any] = {"type": "input_image", "image_url": img(w, h, *rng.choice(_FORMATS[:5]))}
            if rng.random() < 0.5:
                p["detail"] = rng.choice(["auto", "low", "high"])
            parts.append(p)
        body: dict[str, Any] = {"input": [{"type": "message", "role": "user", "content": parts}]}
        if n % 2:
            body["instructions"] = "Answer briefly."
        cases.append(MMCase(f"responses-{n}", "responses", body))

    # Messages: image blocks (base64 sources), in user content and in tool results.
    def block(w: int, h: int, fmt: str = "PNG", mode: str = "RGB") -> dict[str, Any]:
        data = base64.b64encode(_image(rng, w, h, fmt, mode)).decode()
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": f"image/{fmt.lower()}", "data": data},
        }

    for n in range(6):
        w, h = rng.choice(_SIZES[:14])
        msgs: list[dict[str, Any]] = [
            {"role": "user", "content": [block(w, h), {"type": "text", "text": "What is it?"}]}
        ]
        if n % 2:
            msgs += [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [
                                {"type": "text", "text": "seen"},
                                block(*rng.choice(_SIZES[:14]), "JPEG"),
                            ],
                        }
                    ],
                },
            ]
        body = {"max_tokens": 64, "messages": msgs}
        if n % 2:
            body["tools"] = [{"name": "look", "input_schema": {"type": "object"}}]
        cases.append(MMCase(f"messages-{n}", "messages", body))
    return cases
