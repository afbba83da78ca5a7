"""Synthetic generators: determinism, shapes against their parameters, token-level sharing, registry."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pytest

from kvrouter.lab.workloads import (
    REGISTRY,
    AllAtOnce,
    Bursts,
    ClosedLoop,
    Constant,
    InvalidParameters,
    Poisson,
    Stage,
    Staged,
    UnknownWorkload,
    Workload,
    arrival_times,
    describe,
    list_workloads,
    make_workload,
    output_tokens,
    prompt_tokens,
    reuse_ceiling,
    reuse_ceiling_by,
    scale_rate,
    summarize,
)

SYNTHETIC = [n for n in list_workloads() if not n.startswith("mooncake")]


def tokens(w: Workload, i: int) -> np.ndarray:
    return np.asarray(prompt_tokens(w.requests[i], w.token_space))


def encoded(w: Workload) -> bytes:
    return msgspec.json.encode(w)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_same_seed_same_workload(name: str) -> None:
    a, b = make_workload(name), make_workload(name)
    assert encoded(a) == encoded(b)
    c = make_workload(name, seed=1)
    assert encoded(a) != encoded(c)
    assert len({r.id for r in a.requests}) == len(a.requests)
    times = [r.arrival_s for r in a.requests]
    if a.closed_loop:
        assert all(t is None for t in times)
    else:
        assert times == sorted(times) and all(t is not None and t >= 0 for t in times)
    assert msgspec.json.decode(encoded(a), type=Workload) == a  # workloads can be saved and reloaded
    assert a.metadata["params"] == describe(name)["params"]
    assert a.metadata["hints"] == describe(name)["hints"]


def test_registry_lists_and_validates() -> None:
    assert set(SYNTHETIC) >= {
        "aws-8k-shared-prefix", "sglang-gsp", "vllm-prefix-repetition", "llmd-precise", "llmd-shared-prefix",
        "llmd-tiered", "multi-turn", "dynamo-prefix-ratio", "rag", "tenants", "short-chat",
    }  # fmt: skip
    assert list_workloads() == sorted(REGISTRY)
    with pytest.raises(UnknownWorkload, match="known: "):
        make_workload("nope")
    with pytest.raises(InvalidParameters, match="unknown field"):
        make_workload("sglang-gsp", groups=3)
    with pytest.raises(InvalidParameters, match="Expected `int`"):
        make_workload("sglang-gsp", num_groups="3")
    with pytest.raises(InvalidParameters, match="rate"):
        make_workload("sglang-gsp", arrival={"type": "poisson", "rate": -1})
    with pytest.raises(InvalidParameters, match="prefix_ratio"):
        make_workload("dynamo-prefix-ratio", prefix_ratio=2.0)
    w = make_workload("sglang-gsp", num_groups=2, prompts_per_group=3, arrival={"type": "poisson", "rate": 5})
    assert len(w.requests) == 6 and w.metadata["params"]["arrival"] == {"type": "poisson", "rate": 5.0}


def test_sglang_gsp_shape() -> None:
    w = make_workload("sglang-gsp")
    assert len(w.requests) == 64 * 16
    assert {r.arrival_s for r in w.requests} == {0.0}
    assert {r.num_prompt_tokens for r in w.requests} == {2048 + 128}
    assert {r.max_output_tokens for r in w.requests} == {256}
    groups = Counter(r.group for r in w.requests)
    assert len(groups) == 64 and set(groups.values()) == {16}
    assert [r.group for r in w.requests[:16]] != [w.requests[0].group] * 16  # shuffled
    by_group: dict[str, list[int]] = {}
    for i, r in enumerate(w.requests):
        by_group.setdefault(r.group or "", []).append(i)
    g0, g1 = list(by_group.values())[:2]
    a, b, c = tokens(w, g0[0]), tokens(w, g0[1]), tokens(w, g1[0])
    assert np.array_equal(a[:2048], b[:2048]) and (a[2048:] != b[2048:]).mean() > 0.9
    assert (a[:2048] != c[:2048]).mean() > 0.9
    assert len({r.segments for r in w.requests}) == 1024  # every prompt once
    assert reuse_ceiling(w, 16) == pytest.approx(2048 / 2176 * (1 - 64 / 1024), abs=1e-9)


def test_llmd_precise_cycles_whole_prompts() -> None:
    w = make_workload("llmd-precise")
    n = len(w.requests)
    stages = w.metadata["params"]["arrival"]["stages"]
    expected = sum(s["rate"] * s["duration_s"] for s in stages)
    assert abs(n - expected) < 4 * expected**0.5
    assert {r.num_prompt_tokens for r in w.requests} == {7200} and {
        r.max_output_tokens for r in w.requests
    } == {1000}
    assert w.requests[0].segments == w.requests[750].segments == w.requests[1500].segments
    assert len({r.segments for r in w.requests[:750]}) == 750
    # Per stage, the arrival count matches the rate (Poisson: within 5 sigma).
    t0 = 0.0
    times = np.array([r.arrival_s for r in w.requests])
    for s in stages:
        got = ((times >= t0) & (times < t0 + s["duration_s"])).sum()
        want = s["rate"] * s["duration_s"]
        assert abs(got - want) < 5 * want**0.5 + 1
        t0 += s["duration_s"]


def test_llmd_profiles_shapes() -> None:
    sp = make_workload("llmd-shared-prefix")
    assert len(sp.requests) == 50 * (2 + 5 + 8 + 10 + 12 + 15 + 20)  # constant rate stages
    assert {r.num_prompt_tokens for r in sp.requests} == {2048 + 256}
    assert len({r.group for r in sp.requests}) == 32
    tiered = make_workload("llmd-tiered", arrival=Staged((Stage(5, 60),)))
    assert {r.num_prompt_tokens for r in tiered.requests} == {16000 + 256}
    assert describe("llmd-tiered")["params"]["num_groups"] == 250


def test_vllm_prefix_repetition_shape() -> None:
    w = make_workload("vllm-prefix-repetition")
    assert len(w.requests) == 1000 and {r.num_prompt_tokens for r in w.requests} == {512}
    assert set(Counter(r.group for r in w.requests).values()) == {100}
    assert reuse_ceiling(w, 16) == pytest.approx(0.5 * (1 - 10 / 1000))


def test_aws_8k_fresh_questions() -> None:
    w = make_workload("aws-8k-shared-prefix", arrival=Poisson(2.0), num_requests=300)
    assert len(w.requests) == 300 and {r.group for r in w.requests} == {"g000"}
    assert all(8100 <= r.num_prompt_tokens <= 8300 for r in w.requests)
    assert len({r.segments[1] for r in w.requests}) == 300  # varied questions
    assert np.array_equal(tokens(w, 0)[:8000], tokens(w, 299)[:8000])
    assert w.metadata["hints"]["instances"] == 7
    assert (
        make_workload("aws-8k-shared-prefix").metadata["params"]["arrival"]["stages"][0]["duration_s"] == 3600
    )


def test_dynamo_prefix_ratio_closed_loop() -> None:
    w = make_workload("dynamo-prefix-ratio")
    assert w.mode == ClosedLoop(20) and len(w.requests) == 200
    assert {r.num_prompt_tokens for r in w.requests} == {14000}
    assert {r.segments[0].length for r in w.requests} == {7000}
    assert len({r.segments[0] for r in w.requests}) == 20
    assert w.metadata["params"]["prefix_ratio"] == 0.5
    low = make_workload("dynamo-prefix-ratio", prefix_ratio=0.1)
    assert {r.segments[0].length for r in low.requests} == {1400}


def test_multi_turn_includes_previous_turns_and_answers() -> None:
    w = make_workload("multi-turn", num_conversations=6, turns=4)
    assert len(w.requests) == 24
    by_session: dict[str, list[int]] = {}
    for i, r in enumerate(w.requests):
        by_session.setdefault(r.session_id or "", []).append(i)
    assert len(by_session) == 6
    for idx in by_session.values():
        turns = [w.requests[i] for i in idx]
        assert [r.turn for r in turns] == [0, 1, 2, 3]
        assert [r.num_prompt_tokens for r in turns] == [1200, 1600, 2000, 2400]
        assert turns[0].depends_on is None
        for prev, cur, i_prev, i_cur in zip(turns, turns[1:], idx, idx[1:]):
            assert cur.depends_on == prev.id and cur.affinity_id == cur.session_id
            assert cur.arrival_s is not None and prev.arrival_s is not None
            assert cur.arrival_s - prev.arrival_s == pytest.approx(8.0 + cur.think_s)
            grown = np.concatenate([tokens(w, i_prev), output_tokens(prev, w.token_space)])
            assert len(grown) == prev.num_prompt_tokens + 200
            assert np.array_equal(tokens(w, i_cur)[: len(grown)], grown)
    first = [w.requests[idx[0]] for idx in by_session.values()]
    assert np.array_equal(
        prompt_tokens(first[0], w.token_space)[:1000], prompt_tokens(first[1], w.token_space)[:1000]
    )  # one shared system prompt
    # Closed loop: conversation after conversation, so clients behave like users.
    closed = make_workload("multi-turn", num_conversations=3, turns=2, arrival=ClosedLoop(2))
    assert [(r.session_id, r.turn) for r in closed.requests] == [
        (f"multi-turn-c{c:05d}", k) for c in range(3) for k in range(2)
    ]
    assert all(r.arrival_s is None for r in closed.requests)
    with pytest.raises(InvalidParameters):
        make_workload("multi-turn", num_requests=10)


def test_rag_documents() -> None:
    w = make_workload("rag", num_requests=600)
    assert all(len(r.segments) == 1 + 3 + 1 for r in w.requests)
    docs = Counter(s for r in w.requests for s in r.segments[1:4])
    assert all(1500 <= d.length <= 4000 for d in docs)
    assert all(len(set(r.segments[1:4])) == 3 for r in w.requests)
    counts = sorted(docs.values(), reverse=True)
    assert counts[0] > 10 * counts[len(counts) // 2]  # Zipf: a few documents dominate
    canonical = make_workload("rag", num_requests=600, order="canonical")
    # Canonical order: one fixed order per set of retrieved documents.
    sets: dict[frozenset[object], tuple[object, ...]] = {}
    for r in canonical.requests:
        sets.setdefault(frozenset(r.segments[1:4]), r.segments[1:4])
        assert sets[frozenset(r.segments[1:4])] == r.segments[1:4]
    assert reuse_ceiling(canonical, 16) >= reuse_ceiling(w, 16)


def test_tenants_salts_isolate_same_prompts() -> None:
    w = make_workload("tenants", num_groups=4, prompts_per_group=4)
    assert len(w.requests) == 4 * 16
    salts = {r.tenant: r.cache_salt for r in w.requests}
    assert len(salts) == 4 and len(set(salts.values())) == 4 and None not in salts.values()
    assert all(r.affinity_id == r.tenant for r in w.requests)
    prompt_sets = {t: {r.segments for r in w.requests if r.tenant == t} for t in salts}
    assert len({frozenset(s) for s in prompt_sets.values()}) == 1  # same prompts for everyone
    per_tenant = reuse_ceiling_by(w, lambda r: r.tenant, 16)
    assert len(per_tenant) == 4
    unsalted = make_workload("tenants", num_groups=4, prompts_per_group=4, salted=False)
    assert {r.cache_salt for r in unsalted.requests} == {None}
    assert reuse_ceiling(unsalted, 16) > reuse_ceiling(w, 16)


def test_short_chat_has_little_sharing() -> None:
    w = make_workload("short-chat", num_requests=500)
    s = summarize(w)
    assert s["requests"] == 500 and 100 < s["input_p50"] < 400
    assert s["reuse_ceiling"] < 0.2
    assert all(1 <= r.max_output_tokens <= 2048 for r in w.requests)


def test_arrival_processes() -> None:
    rng = np.random.default_rng(0)
    assert arrival_times(AllAtOnce(2.0), 3, rng) == [2.0, 2.0, 2.0]
    assert arrival_times(Constant(4.0), 3, rng) == [0.0, 0.25, 0.5]
    assert arrival_times(Bursts(size=2, interval_s=3.0), 5, rng) == [0.0, 0.0, 3.0, 3.0, 6.0]
    assert arrival_times(ClosedLoop(4), 10, rng) is None
    p = arrival_times(Poisson(10.0), 20000, rng)
    assert p is not None and 20000 / p[-1] == pytest.approx(10.0, rel=0.03)
    staged = arrival_times(Staged((Stage(2, 10), Stage(5, 10)), poisson=False), None, rng)
    assert staged is not None and len(staged) == 70 and staged[20] == 10.0
    capped = arrival_times(Staged((Stage(2, 10),)), 5, rng)
    assert capped is not None and len(capped) == 5
    with pytest.raises(ValueError):
        arrival_times(Poisson(1.0), None, rng)
    w = make_workload("sglang-gsp", num_groups=2, prompts_per_group=2, arrival=Bursts(size=2, interval_s=1.0))
    assert [r.arrival_s for r in w.requests] == [0.0, 0.0, 1.0, 1.0]
    fast = scale_rate(w, 2.0)
    assert [r.arrival_s for r in fast.requests] == [0.0, 0.0, 0.5, 0.5] and fast.metadata[
        "rate_multiplier"
    ] == 2.0


def test_sglang_gsp_grouped_is_the_same_prompts_in_group_order() -> None:
    """``grouped`` reorders the fixed set (one group after another, for bursts of one new prefix each);
    the prompts themselves are those of the shuffled set with the same seed."""
    params = {"num_groups": 4, "prompts_per_group": 3, "system_len": 64, "question_len": 8, "output_len": 4}
    shuffled = make_workload("sglang-gsp", seed=3, **params)
    grouped = make_workload("sglang-gsp", seed=3, grouped=True, **params)
    runs = [r.group for r in grouped.requests]
    assert runs == sorted(runs) and len(set(runs)) == 4
    assert [r.group for r in shuffled.requests] != runs

    def prompts(w: Workload) -> list[tuple[str | None, bytes]]:
        return sorted((r.group, tokens(w, i).tobytes()) for i, r in enumerate(w.requests))

    assert prompts(grouped) == prompts(shuffled)
    with pytest.raises(ValueError, match="grouped"):
        make_workload("sglang-gsp", grouped=True, fresh_questions=True, **params)


def test_multimodal_agent_resends_screenshots_and_shares_figures() -> None:
    w = make_workload("multimodal-agent", num_sessions=3, turns=3, num_questions=40, num_documents=4)
    pad = None
    sessions: dict[str, list[int]] = {}
    for i, r in enumerate(w.requests):
        toks = tokens(w, i)
        assert r.num_prompt_tokens == len(toks)
        for it in r.items:  # every image is a run of the placeholder stream: equal tokens for equal sizes
            run = toks[it.offset : it.offset + it.length]
            pad = run if pad is None or len(run) > len(pad) else pad
            assert np.array_equal(run, pad[: len(run)])
        if r.session_id is not None:
            sessions.setdefault(r.session_id, []).append(i)
    assert len(sessions) == 3
    for idx in sessions.values():
        turns = [w.requests[i] for i in idx]
        assert [len(r.items) for r in turns] == [1, 2, 3]
        for prev, cur, i_prev, i_cur in zip(turns, turns[1:], idx, idx[1:]):
            assert cur.items[: len(prev.items)] == prev.items  # the same screenshots at the same places
            grown = np.concatenate([tokens(w, i_prev), output_tokens(prev, w.token_space)])
            assert np.array_equal(tokens(w, i_cur)[: len(grown)], grown)
            assert cur.depends_on == prev.id
        assert all(it.length == 1196 for r in turns for it in r.items)
    questions = [r for r in w.requests if r.session_id is None]
    assert len(questions) == 40
    by_doc: dict[str | None, set[tuple[object, ...]]] = {}
    for r in questions:
        by_doc.setdefault(r.group, set()).add(r.items)
        assert len(r.items) == 4 and all(it.length == 609 for it in r.items)
    assert all(len(v) == 1 for v in by_doc.values())  # one document, the same figures for every user
    assert len({it.identifier for r in questions for it in r.items}) == 4 * len(by_doc)
    with pytest.raises(InvalidParameters, match="tokens form"):
        make_workload("multimodal-agent", form="chat")
    with pytest.raises(InvalidParameters):
        make_workload("multimodal-agent", num_requests=10)
