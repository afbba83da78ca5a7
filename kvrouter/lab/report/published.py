"""Figures others published, to print beside ours (never used in any computation of ours).

Sources, as summarised in the project's ``shared/reference/anchors.md`` and ``shared/traces/README.md``:

* Amazon SageMaker PREFIX_AWARE routing vs RANDOM: Llama 3.1 70B on 7 x p5.48xlarge, vLLM with prefix
  caching, 1 h, one 8k-token shared prefix; and short ShareGPT-like chats (vendor-reported).
* Mooncake (FAST'25) paper, conversation trace, 16 nodes of 8 x A800: average TTFT per scheduler.
* SageMaker HyperPod, KV-aware routing with its managed tiered KV cache (L1 CPU, L2 shared).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import msgspec


class Reported(msgspec.Struct, frozen=True):
    """A published range (``lo == hi`` for a single figure)."""

    lo: float
    hi: float

    def text(self, *, percent: bool = True, signed: bool = True) -> str:
        def one(v: float) -> str:
            if not percent:
                return f"{v:g}"
            digits = 1 if abs(v) < 0.1 else 0  # AWS's +1.7 % is not +2 %
            return f"{v * 100:+.{digits}f} %" if signed else f"{v * 100:.{digits}f} %"

        return one(self.lo) if self.lo == self.hi else f"{one(self.lo)} .. {one(self.hi)}"


AWS_8K_SHARED_PREFIX: Mapping[str, Reported] = MappingProxyType(
    {
        "ttft_p50_s": Reported(-0.77, -0.71),
        "ttft_p90_s": Reported(-0.37, -0.33),
        "throughput_tok_s": Reported(0.15, 0.16),
    }
)
"""SageMaker PREFIX_AWARE relative to RANDOM on the 8k shared prefix (changes as fractions)."""

AWS_8K_HIT_RATE = {"random": 0.25, "prefix-aware": 0.82}
"""KV-cache hit rates AWS reported on the 8k shared prefix."""

AWS_SHORT_CHAT: Mapping[str, Reported] = MappingProxyType(
    {
        "ttft_p50_s": Reported(-0.16, -0.13),
        "ttft_p90_s": Reported(-0.37, -0.24),
        "throughput_tok_s": Reported(0.017, 0.02),
    }
)
"""SageMaker PREFIX_AWARE relative to RANDOM on short ShareGPT-like chats."""

MOONCAKE_PAPER_MEAN_TTFT_S = MappingProxyType(
    {"random": 19.65, "load-balancing": 5.27, "local cache-aware": 3.58, "global cache-aware": 3.07}
)
"""Mooncake paper, conversation trace: average TTFT per scheduler (their Fig. / text)."""

HYPERPOD_TIERED: Mapping[str, Reported] = MappingProxyType(
    {
        "ttft": Reported(-0.40, -0.40),
        "throughput": Reported(0.25, 0.25),
        "cost": Reported(-0.25, -0.25),
    }
)
"""SageMaker HyperPod's KV-aware routing with its managed tiered KV cache (L1 in each instance's CPU
memory, L2 shared), "up to" figures for long-context prompts and multi-turn chat, measured with AWS's
internal tools (AWS Machine Learning blog, "Managed Tiered KV Cache and Intelligent Routing for Amazon
SageMaker HyperPod", Nov 2025; anchors.md).  Baseline, fleet and load are not published."""
