"""Retrieval-augmented generation over a fixed document set.

::

    request:  [system][doc a][doc b][doc c][question]      a, b, c: k distinct documents, Zipf-popular

Documents are a few thousand tokens each; popular ones recur across requests.  A prefix cache only
reuses the documents up to the first one that differs from an earlier prompt, so the order of retrieved
documents matters: ``retrieval`` keeps the retriever's order (most relevant first: the draw order, which
differs between requests retrieving the same set), ``canonical`` sorts them by document id (a known trick
that lets requests retrieving the same set share all of it).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from kvrouter.lab.workloads.arrivals import Arrival, Poisson
from kvrouter.lab.workloads.build import GeneratorParams, Keys, Renderer, assemble, rng_for, schedule
from kvrouter.lab.workloads.spec import Request, Role, Segment, Workload


class RagParams(GeneratorParams, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """RAG: system + k retrieved documents + question."""

    num_documents: int = 500
    """Documents in the corpus."""
    doc_len_min: int = 1500
    """Shortest document, tokens (lengths uniform in ``[doc_len_min, doc_len_max]``)."""
    doc_len_max: int = 4000
    """Longest document, tokens."""
    docs_per_request: int = 3
    """Documents retrieved per request (distinct)."""
    zipf_s: float = 1.1
    """Popularity exponent: document of rank r is retrieved with weight ``r ** -zipf_s``."""
    order: Literal["retrieval", "canonical"] = "retrieval"
    """Order of documents in the prompt (see the module docstring)."""
    system_len: int = 300
    """Tokens of the shared system prompt."""
    question_len: int = 100
    """Tokens of each (unique) question."""
    output_len: int = 200
    """Tokens generated per request."""
    num_requests: int | None = 2000
    arrival: Arrival = Poisson(4.0)

    def __post_init__(self) -> None:
        if not 1 <= self.docs_per_request <= self.num_documents:
            raise ValueError("docs_per_request must be in [1, num_documents]")
        if not 0 <= self.doc_len_min <= self.doc_len_max:
            raise ValueError("0 <= doc_len_min <= doc_len_max required")
        if self.zipf_s < 0 or min(self.system_len, self.question_len) < 0 or self.output_len < 1:
            raise ValueError("zipf_s >= 0, lengths >= 0 and output_len >= 1 required")


def rag(name: str, params: RagParams) -> Workload:
    """Build RAG requests over one document set."""
    times = schedule(params, params.num_requests or 0)
    rng = rng_for(params, "retrieval")
    keys = Keys(params.seed, name)
    render = Renderer(params.form)
    doc_lens = rng.integers(params.doc_len_min, params.doc_len_max + 1, params.num_documents).tolist()
    # Popularity rank is independent of document id, so canonical order is not popularity order.
    weights = np.arange(1, params.num_documents + 1, dtype=float) ** -params.zipf_s
    popularity = rng.permutation(params.num_documents)
    p = np.empty(params.num_documents)
    p[popularity] = weights / weights.sum()
    system = keys.segment(params.system_len, "system")
    requests = []
    for i, t in enumerate(times):
        docs = rng.choice(params.num_documents, size=params.docs_per_request, replace=False, p=p).tolist()
        if params.order == "canonical":
            docs.sort()
        parts: list[tuple[Role, Segment]] = [("system", system)]
        parts += [("user", keys.segment(doc_lens[d], "doc", d)) for d in docs]
        parts.append(("user", keys.segment(params.question_len, "question", i)))
        requests.append(
            Request(
                id=f"{name}-{i:06d}",
                arrival_s=t,
                max_output_tokens=params.output_len,
                group=f"d{docs[0]:04d}",
                **render.fields(parts),
            )
        )
    return assemble(name, params, requests)
