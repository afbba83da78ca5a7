"""vLLM's own per-block extra keys for recorded prompts (dev tool; run with the vLLM virtualenv's python).

Reads JSON lines on stdin, ``{"id", "num_tokens", "block_size", "cache_salt", "features": {modality:
[[identifier, offset, length], ...]}}``, and writes one JSON line per case: ``{"id", "event_extra_keys"}``,
what vLLM's block pool puts in ``BlockStored.extra_keys`` for the prompt's full blocks.  The keys come from
vLLM's ``generate_block_hash_extra_keys`` walked over the blocks as ``BlockPool.cache_full_blocks`` walks
them (the multimodal index carried from block to block), then ``to_event_extra_keys``, on a request that
holds only what those functions read (its multimodal features, LoRA, salt, prompt embeddings).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys


def features(raw: dict[str, list[list[Any]]]) -> list[MultiModalFeatureSpec]:
    out = [
        MultiModalFeatureSpec(
            data=None,
            modality=modality,
            identifier=ident,
            mm_position=PlaceholderRange(offset=offset, length=length),
            mm_hash=ident,
        )
        for modality, items in raw.items()
        for ident, offset, length in items
    ]
    out.sort(key=lambda f: f.mm_position.offset)  # vLLM sorts the features by position
    return out


def main() -> None:
    for line in sys.stdin:
        case = json.loads(line)
        req = SimpleNamespace(
            mm_features=features(case["features"]),
            lora_request=None,
            cache_salt=case.get("cache_salt"),
            prompt_embeds=None,
        )
        bs = case["block_size"]
        keys = []
        mm_idx = 0
        for b in range(case["num_tokens"] // bs):
            k, mm_idx = generate_block_hash_extra_keys(req, b * bs, (b + 1) * bs, mm_idx)  # type: ignore[arg-type]
            keys.append(k)
        event = to_event_extra_keys(keys)
        print(json.dumps({"id": case["id"], "event_extra_keys": event}), flush=True)


if __name__ == "__main__":
    main()
