"""The environment variables a vLLM server reads that change what the simulated one serves (read here and
only here, when an instance is built; the instance's config may set each explicitly instead)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvrouter.lab.sim.errors import SimConfigError

RESPONSES_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"
"""vLLM keeps Responses API answers (and their conversations) in memory only with this set to 1:
otherwise ``store`` is silently ignored and every ``previous_response_id`` is a 404."""
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set to 1 or true."""


def responses_store(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's reading: an integer, non-zero means on (anything else stops the server)."""
    raw = environ.get(RESPONSES_STORE_ENV, "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise SimConfigError(f"{RESPONSES_STORE_ENV} must be an integer, got {raw!r}") from None


def runtime_lora(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's reading: "1" or "true" (any case, surrounding blanks ignored) means on."""
    return environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
