"""Token-parity state per model, against a plain reference model, and its small helpers."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.api import parse_body
from kvrouter.config import ParityConfig
from kvrouter.pipeline.parity import (
    ParityStatus,
    ParityTracker,
    ProbeCase,
    first_difference,
    probe_request,
    tokenize_body,
)

MODELS = ["a", "b"]


def reference_first_difference(x: list[int], y: list[int]) -> int | None:
    for i in range(max(len(x), len(y))):
        if i >= len(x) or i >= len(y) or x[i] != y[i]:
            return i
    return None


@given(st.lists(st.integers(0, 3), max_size=8), st.lists(st.integers(0, 3), max_size=8))
def test_first_difference(x: list[int], y: list[int]) -> None:
    assert first_difference(x, y) == reference_first_difference(x, y)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("check"), st.sampled_from(MODELS), st.sampled_from(["match", "mismatch", "error"])),
        st.tuples(st.just("recheck"), st.sampled_from(MODELS), st.integers(0, 4)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_tracker_against_a_reference(ops: list[tuple[str, str, object]]) -> None:
    """Reference: a model is failing from its first mismatch until a recheck in which every one of its
    probes matched (matches counted since the last mismatch); ok once any check matched; unknown before."""
    t = ParityTracker(ParityConfig())
    status = dict.fromkeys(MODELS, "unknown")
    since_fail = dict.fromkeys(MODELS, 0)
    for op, model, arg in ops:
        if op == "check":
            ours = [1, 2, 3]
            theirs = None if arg == "error" else ([1, 2, 3] if arg == "match" else [1, 9, 3])
            got = t.record(ProbeCase(model, {}, ours, "sample"), theirs, "i", 0.0)
            assert got == arg
            if arg == "mismatch":
                status[model] = "failing"
                since_fail[model] = 0
            elif arg == "match":
                if status[model] == "failing":
                    since_fail[model] += 1
                else:
                    status[model] = "ok"
        else:
            assert isinstance(arg, int)
            t.recheck_done(model, arg)
            if status[model] == "failing" and arg and since_fail[model] >= arg:
                status[model] = "ok"
            since_fail[model] = 0
        for m in MODELS:
            want = status[m]
            got_status = t.models[m].status if m in t.models else ParityStatus.UNKNOWN
            assert got_status == want, (m, ops)
            assert t.trusted(m) == (want != "failing")
    assert sorted(str(m) for m in t.failing()) == sorted(m for m in MODELS if status[m] == "failing")


def test_a_mismatch_is_kept_with_its_first_position_and_lengths() -> None:
    t = ParityTracker(ParityConfig())
    t.record(ProbeCase("m", {}, [1, 2, 3, 4], "shortfall"), [1, 2, 7], "sim-1", 5.0)
    mm = t.of("m").last_mismatch
    assert mm is not None and (mm.position, mm.ours, mm.theirs, mm.instance, mm.reason) == (
        2,
        4,
        3,
        "sim-1",
        "shortfall",
    )
    assert t.state()["models"]["m"]["status"] == "failing"


def test_sampling_takes_the_configured_fraction_and_the_queue_is_bounded() -> None:
    req = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', "chat")
    t = ParityTracker(ParityConfig(sample_rate=0.25, queue=1000), rng=random.Random(3))
    for _ in range(4000):
        t.routed(req, [1, 2], "i")
    assert 850 < len(t.take()) < 1150
    full = ParityTracker(ParityConfig(sample_rate=1.0, queue=5))
    for _ in range(9):
        full.routed(req, [1, 2], "i")
    assert len(full.take()) == 5 and full.dropped == 4


def test_shortfall_of_a_block_or_more_queues_a_check() -> None:
    req = parse_body(b'{"model": "m", "prompt": "hello"}', "completions")
    t = ParityTracker(ParityConfig(sample_rate=0.0))
    t.shortfall(req, [1, 2, 3], "i", predicted=32, reported=17, block_size=16)
    assert t.take() == []
    t.shortfall(req, [1, 2, 3], "i", predicted=32, reported=16, block_size=16)
    (case,) = t.take()
    assert case.reason == "shortfall" and case.body == {
        "model": "m",
        "prompt": "hello",
        "add_special_tokens": True,
    }


def test_tokenize_body_carries_what_renders_and_refuses_what_tokenize_cannot_express() -> None:
    chat = parse_body(
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [], "max_tokens": 3,'
        b' "chat_template_kwargs": {"thinking": true}, "add_generation_prompt": false}',
        "chat",
    )
    assert tokenize_body(chat) == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [],
        "chat_template_kwargs": {"thinking": True},
        "add_generation_prompt": False,
        "add_special_tokens": False,
    }
    docs = parse_body(b'{"messages": [{"role": "user", "content": "x"}], "documents": [{"a": "b"}]}', "chat")
    assert tokenize_body(docs) is None
    ids = parse_body(b'{"prompt": [1, 2, 3]}', "completions")
    assert tokenize_body(ids) is None


def test_responses_and_messages_are_probed_on_their_render_routes_as_sent() -> None:
    """Never the router's own conversion: the body as the client sent it, to vLLM's render route."""
    body = b'{"model": "m", "input": [{"role": "user", "content": "x"}], "instructions": "s"}'
    resp = parse_body(body, "responses")
    assert probe_request(resp) == (
        "/v1/responses/render",
        {"model": "m", "input": [{"role": "user", "content": "x"}], "instructions": "s"},
    )
    assert tokenize_body(resp) is None
    cont = parse_body(b'{"model": "m", "input": "x", "previous_response_id": "resp_1"}', "responses")
    assert probe_request(cont) is None
    msgs = parse_body(
        b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}', "messages"
    )
    path, sent = probe_request(msgs) or ("", {})
    assert path == "/v1/messages/render" and sent["messages"] == [{"role": "user", "content": "x"}]
    t = ParityTracker(ParityConfig(sample_rate=1.0))
    t.routed(msgs, [1, 2], "i")
    (case,) = t.take()
    assert (case.path, case.route, case.instance) == ("/v1/messages/render", "messages", "i")


def test_cached_tokens_verdicts_for_routes_without_render() -> None:
    msgs = parse_body(
        b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}', "messages"
    )
    chat = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', "chat")
    t = ParityTracker(ParityConfig(sample_rate=0.0, shortfall_blocks=1))
    assert t.cached_tokens_check(msgs, [1], predicted=32, reported=32, block_size=16) == "match"
    assert t.cached_tokens_check(msgs, [1], predicted=32, reported=16, block_size=16) == "shortfall"
    assert t.cached_tokens_check(msgs, [1], predicted=8, reported=0, block_size=16) is None
    assert t.cached_tokens_check(chat, [1], predicted=32, reported=0, block_size=16) is None
    assert t.of("m").checks == {"cached_tokens_match": 1, "cached_tokens_shortfall": 1}
    assert t.trusted("m"), "a shortfall alone does not fail the model"
