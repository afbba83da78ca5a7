"""The conversations kept for Responses continuations, against a plain reference: a recency list bounded
by entries and by bytes."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.api.parsed import StoredConversation
from kvrouter.pipeline.response_history import ResponseHistory

IDS = st.sampled_from([f"resp_{i}" for i in range(8)])
CONV = st.builds(
    lambda n, k: StoredConversation([{"role": "user", "content": "x" * n}], [{"type": "message", "k": k}]),
    st.integers(0, 120),
    st.integers(0, 3),
)
OPS = st.lists(st.one_of(st.tuples(st.just("put"), IDS, CONV), st.tuples(st.just("get"), IDS)), max_size=60)


class Reference:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.order: list[tuple[str, StoredConversation, int]] = []  # least recent first

    def put(self, rid: str, conv: StoredConversation) -> None:
        if self.max_entries <= 0:
            return
        self.order = [e for e in self.order if e[0] != rid]
        size = len(msgspec.json.encode(conv))
        if size > self.max_bytes:
            return
        self.order.append((rid, conv, size))
        while len(self.order) > self.max_entries or sum(e[2] for e in self.order) > self.max_bytes:
            self.order.pop(0)

    def get(self, rid: str) -> StoredConversation | None:
        for i, e in enumerate(self.order):
            if e[0] == rid:
                self.order.append(self.order.pop(i))
                return e[1]
        return None


@given(st.integers(0, 5), st.integers(0, 600), OPS)
def test_history_behaves_as_the_reference(max_entries: int, max_bytes: int, ops: list[tuple]) -> None:
    h, ref = ResponseHistory(max_entries, max_bytes), Reference(max_entries, max_bytes)
    for op in ops:
        if op[0] == "put":
            h.put(op[1], op[2])
            ref.put(op[1], op[2])
        else:
            assert h.get(op[1]) == ref.get(op[1])
        assert len(h) == len(ref.order)
        assert h.bytes == sum(e[2] for e in ref.order) <= max(max_bytes, 0)
