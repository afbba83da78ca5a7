"""SLO-aware admission: a request may state the time to first token and the time per output token it
needs (``x-slo-ttft-ms``, ``x-slo-tpot-ms``, as the inference extension's latency-based routing reads
them).  Before it waits for capacity, the router predicts both where it would go; one it cannot meet is
refused at once (429, ``on_miss: reject``) or served at ``demote_priority`` (``on_miss: demote``), the
reason in the answer's ``x-kvrouter-slo`` header and in ``kvrouter_flow_slo_total``.  Pure.

The prediction is deliberately plain, from what the router already counts per target::

    ttft = (tokens still to prefill there + this prompt's tokens not cached there) / prefill_tokens_per_s
    tpot = decode_step_s + decode_step_per_request_s x requests decoding there

and the best target (the least predicted TTFT) decides.  The rates are the fleet's own, measured once
(``kvrouter bench`` against the engines, or their ``vllm:time_to_first_token_seconds`` and
``vllm:inter_token_latency_seconds``); a wrong rate errs the same way for every request.  With
``learned`` (the default), once every candidate's latency models are warm (``routing.predicted_latency``,
trained on the fleet's own times under every policy) their predictions replace the rates: per instance,
so a mixed fleet's slow instances are known.  A request stating no objective is not predicted; one whose
objective nothing predicts is answered ``not_predicted``.  A malformed objective is ignored (counted)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from indexer.errors import ConfigError

OnMiss = Literal["reject", "demote"]


class SloConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The fleet file's ``flows.slo`` section."""

    ttft_header: str | None = "x-slo-ttft-ms"
    tpot_header: str | None = "x-slo-tpot-ms"
    on_miss: OnMiss = "demote"
    demote_priority: int = -1
    """The priority a request that cannot meet its objective is served at (below 0: sheddable, so it is
    served only while the fleet is not saturated)."""
    prefill_tokens_per_s: float = 0.0
    """The fleet's prefill rate per instance (0: TTFT objectives are not predicted)."""
    decode_step_s: float = 0.0
    """A decode step's time with one request (0: TPOT objectives are not predicted) ..."""
    decode_step_per_request_s: float = 0.0
    """... and what each further request decoding in the same batch adds."""
    learned: bool = True
    """Once every candidate's latency models are warm, predict from them instead of the rates (learned
    per instance from the fleet's own times; the rates stay the prediction while any is cold)."""

    def validate(self) -> None:
        if min(self.prefill_tokens_per_s, self.decode_step_s, self.decode_step_per_request_s) < 0:
            raise ConfigError("flows.slo: rates and step times must be >= 0")
        if self.on_miss not in ("reject", "demote"):
            raise ConfigError("flows.slo.on_miss must be reject or demote")


class Objective(msgspec.Struct, frozen=True):
    ttft_s: float | None = None
    tpot_s: float | None = None


def read_objective(cfg: SloConfig, headers: Mapping[str, str]) -> tuple[Objective | None, list[str]]:
    """The request's objective (None: it states none) and the headers ignored (``header:malformed``):
    a positive number of milliseconds, finite."""
    notes: list[str] = []
    got: dict[str, float] = {}
    for field, name in (("ttft_s", cfg.ttft_header), ("tpot_s", cfg.tpot_header)):
        raw = headers.get(name.lower()) if name else None
        if raw is None:
            continue
        try:
            ms = float(raw.strip())
        except ValueError:
            ms = float("nan")
        if not 0 < ms < 1e9:  # also NaN and inf
            notes.append(f"{field.removesuffix('_s')}_slo:malformed")
            continue
        got[field] = ms / 1e3
    return (Objective(**got) if got else None), notes


class TargetView(msgspec.Struct, frozen=True):
    """What the prediction reads of one target (``routing.Candidate``'s fields)."""

    pending_prefill_tokens: int
    uncached_tokens: int
    decoding: int


def predict(cfg: SloConfig, targets: Iterable[TargetView]) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) at the target with the least predicted TTFT (None: not predicted)."""
    rate = cfg.prefill_tokens_per_s
    ttft, tpot = best(
        (
            (t.pending_prefill_tokens + t.uncached_tokens) / rate if rate else 0.0,
            cfg.decode_step_s + cfg.decode_step_per_request_s * t.decoding,
        )
        for t in targets
    )
    return (ttft if rate else None), (tpot if cfg.decode_step_s else None)


def best(predictions: Iterable[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) of the prediction with the least TTFT, the first of equals (None, None: no
    prediction); the rates' (``predict``) and the learned models' alike."""
    return min(predictions, default=(None, None), key=lambda p: p[0])


def miss(objective: Objective, ttft_s: float | None, tpot_s: float | None) -> str | None:
    """Which objective the prediction misses (``ttft`` first), or None."""
    if objective.ttft_s is not None and ttft_s is not None and ttft_s > objective.ttft_s:
        return "ttft"
    if objective.tpot_s is not None and tpot_s is not None and tpot_s > objective.tpot_s:
        return "tpot"
    return None
