"""A chat with one image, as the multimodal gateway tests send it (simulated and real fleets alike)."""

from __future__ import annotations

import base64
import io
from typing import Any

from PIL import Image


def png_url(w: int, h: int, seed: int) -> str:
    """A ``data:`` URL of a PNG of varied pixels (a flat colour would compress to nothing and say little
    about decoding); another ``seed`` is another image of the same size."""
    im = Image.new("RGB", (w, h))
    im.putdata([((x * seed) % 256, (y * 7 + seed) % 256, (x ^ y) % 256) for y in range(h) for x in range(w)])
    out = io.BytesIO()
    im.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_chat(model: str, system: str, image: str, question: str) -> dict[str, Any]:
    """A system prompt, then a user turn of text, the image and the question; two tokens out."""
    return {
        "model": model,
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here is the screen:"},
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": question},
                ],
            },
        ],
    }
