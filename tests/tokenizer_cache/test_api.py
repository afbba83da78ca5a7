"""Loading, the registry, token-id prompts, stats, async use, concurrency and the memory bound."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.support.tokenizer_kit import SPECIAL_STRINGS, build_bytelevel, build_metaspace, corpus_text
from tests.support.tokenizers import chat_ids, chat_text
from tokenizer_cache import (
    CacheConfig,
    CachedTokenizer,
    InvalidPromptError,
    TokenizerLoadError,
    TokenizerRegistry,
    chat_body,
    default_tokenizer_path,
    load_chat_template,
)
from tokenizer_cache.seams import AddedTokenMargin, reuse_blockers, start_sensitive

TIGHT = CacheConfig(chunk_chars=32, margin_chars=8, overlap_chars=4, seam_stride_tokens=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("api"))
    return {
        "deepseek": default_tokenizer_path(),
        "bytelevel": build_bytelevel(root / "bl"),
        "metaspace": build_metaspace(root / "ms"),
    }


@pytest.fixture(scope="module")
def deepseek() -> Iterator[CachedTokenizer]:
    ct = CachedTokenizer.from_pretrained(default_tokenizer_path(), config=TIGHT)
    yield ct
    ct.close()


def test_default_tokenizer_loads_offline(deepseek: CachedTokenizer) -> None:
    path = Path(default_tokenizer_path())
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    assert deepseek.reuse_blockers == [] and deepseek.stats().reuse_enabled
    assert deepseek.encode_prompt("Hello world").tokens == [19923, 2058]  # no BOS: add_bos_token is false
    assert deepseek.hf_tokenizer.chat_template is None


def test_warm_leaves_nothing_for_the_first_request_to_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm`` (``kvrouter serve`` calls it before forking its workers) computes what a first chat request
    would: after it, the vocabulary is not read and the template not compiled again, and the ids are the
    ones a tokenizer never warmed gives."""
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]}
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"

    def load() -> CachedTokenizer:
        return CachedTokenizer.from_pretrained(default_tokenizer_path(), config=TIGHT, chat_template=template)

    want = list(load().encode_chat_request(body).tokens)
    ct = load()
    ct.warm()

    def again(*_: Any, **__: Any) -> None:
        raise AssertionError("computed again on the first request")

    monkeypatch.setattr(ct.hf_tokenizer, "get_vocab", again)
    monkeypatch.setattr(ct._renderer._templates._env, "from_string", again)
    monkeypatch.setattr("tokenizer_cache.chat.requires_system_first", again)
    assert list(ct.encode_chat_request(body).tokens) == want
    assert ct._renderer.merges_inline_system() in (True, False)


def test_missing_tokenizer_is_a_load_error_and_never_downloads(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="offline"):
        CachedTokenizer.from_pretrained("kvrouter-tests/no-such-model-anywhere")
    with pytest.raises(TokenizerLoadError):
        CachedTokenizer.from_pretrained(str(tmp_path / "empty"))


def test_load_chat_template(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages }}", encoding="utf-8")
    assert load_chat_template(str(f)) == "{{ messages }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(TokenizerLoadError):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_token_id_prompts_pass_through_validated(deepseek: CachedTokenizer) -> None:
    assert deepseek.encode_prompt([1, 2, 3]).tokens == [1, 2, 3]
    assert deepseek.encode_prompt((5, 6)).tokens == [5, 6]
    for bad in ([1, -1], [deepseek.vocab_size], [True], [1.0], b"abc", 7):
        with pytest.raises(InvalidPromptError):
            deepseek.encode_prompt(bad)  # type: ignore[arg-type]


def test_reuse_blockers_refuse_unproven_pipelines() -> None:
    spec = json.loads((Path(default_tokenizer_path()) / "tokenizer.json").read_text(encoding="utf-8"))
    assert reuse_blockers(spec) == []
    behind = dict(spec, pre_tokenizer={"type": "Split", "pattern": {"Regex": "(?<=a)b|^x"}})
    assert reuse_blockers(behind) == ["Split regex uses lookbehind", "Split regex uses ^"]
    assert reuse_blockers(dict(spec, model=dict(spec["model"], dropout=0.1))) != []
    assert reuse_blockers(dict(spec, normalizer={"type": "SomethingNew"})) == ["normalizer SomethingNew"]


def test_unproven_pipeline_runs_uncached(dirs: dict[str, str], tmp_path: Path) -> None:
    spec = json.loads((Path(dirs["bytelevel"]) / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["dropout"] = 0.0  # falsy: still fine
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\b"}, "behavior": "Isolated", "invert": False},
            spec["pre_tokenizer"],
        ],
    }
    d = tmp_path / "lookbehind"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (d / "tokenizer_config.json").write_bytes(
        (Path(dirs["bytelevel"]) / "tokenizer_config.json").read_bytes()
    )
    ct = CachedTokenizer.from_pretrained(str(d), config=TIGHT)
    assert ct.reuse_blockers == ["Split regex uses \\b"]
    text = corpus_text(random.Random(1), 100)
    for _ in range(2):
        assert ct.encode_prompt(text).tokens == ct.encode_uncached(text)
    st = ct.stats()
    assert not st.reuse_enabled and st.entries == 0 and st.hits == 0


def test_stats_and_reused_prefix_length(deepseek: CachedTokenizer) -> None:
    deepseek.clear()
    before = deepseek.stats()
    text = corpus_text(random.Random(2), 200)
    first = deepseek.encode_prompt(text)
    again = deepseek.encode_prompt(text)
    longer = deepseek.encode_prompt(text + " and a new question?")
    st = deepseek.stats()
    assert first.reused_tokens == 0 and again.reused_tokens == len(again.tokens)
    assert 0 < longer.reused_tokens < len(longer.tokens)
    assert longer.tokens == deepseek.encode_uncached(text + " and a new question?")
    assert st.lookups - before.lookups == 3 and st.misses - before.misses == 1
    assert st.exact_hits - before.exact_hits == 1 and st.hits - before.hits == 2
    assert st.entries == 1  # the longer text superseded the first
    assert st.tokens_reused - before.tokens_reused == again.reused_tokens + longer.reused_tokens
    assert st.bytes_held > 0


def test_registry_default_overrides_and_single_load(dirs: dict[str, str]) -> None:
    reg = TokenizerRegistry(
        dirs["deepseek"], {"small": dirs["bytelevel"], "alias": dirs["deepseek"]}, config=TIGHT
    )
    with pytest.raises(TokenizerLoadError):
        TokenizerRegistry(None, {}).get("anything")
    got: list[CachedTokenizer] = []
    threads = [threading.Thread(target=lambda: got.append(reg.get("small"))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(t) for t in got}) == 1, "loaded more than once"
    assert reg.get("small").encode_prompt("hi").tokens[0] == 0  # bytelevel's BOS
    assert reg.get(None) is reg.get("unknown-model") is reg.get("alias")  # same path: one cache
    fleet = {"tokenizer": dirs["deepseek"], "models": {"m1": {"tokenizer": dirs["metaspace"]}, "m2": {}}}
    reg2 = TokenizerRegistry.from_fleet(fleet, config=TIGHT)
    assert reg2.resolve("m1") == (dirs["metaspace"], None) and reg2.resolve("m2") == (dirs["deepseek"], None)
    assert len(reg.loaded()) == 2
    reg.close()
    reg2.close()


def test_registry_chat_template_from_fleet(dirs: dict[str, str]) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    reg = TokenizerRegistry.from_fleet(
        {"tokenizer": dirs["deepseek"], "chat_template": template}, config=TIGHT
    )
    assert chat_text(reg.get("any"), [{"role": "user", "content": "hi"}]) == "[user] hi\n"
    reg.close()


def test_concurrent_threads_get_exact_tokens(dirs: dict[str, str]) -> None:
    ct = CachedTokenizer.from_pretrained(dirs["bytelevel"], config=TIGHT)
    rng = random.Random(3)
    base = corpus_text(rng, 150, SPECIAL_STRINGS["bytelevel"])
    texts = [base[: rng.randrange(len(base))] + corpus_text(rng, rng.randrange(6)) for _ in range(120)]
    texts += texts[:40]  # repeats race with their first insertion
    want = {t: ct.encode_uncached(t) for t in texts}
    errors: list[str] = []

    def worker(k: int) -> None:
        order = texts[k::4] + texts[: k * 7]
        for t in order:
            if ct.encode_prompt(t).tokens != want[t]:
                errors.append(t)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ct.check_invariants()
    assert ct.stats().hits > 0


async def test_async_variants_keep_long_encodes_off_the_loop(dirs: dict[str, str]) -> None:
    """The async methods tokenize what is left after the cache on the loop when it is short (a hop to a
    thread costs more), and every longer encode (a miss: the whole prompt) on the executor."""
    limit = 64
    ct = CachedTokenizer.from_pretrained(
        dirs["bytelevel"], config=msgspec.structs.replace(TIGHT, inline_chars=limit)
    )
    loop_thread = threading.get_ident()
    calls: list[tuple[int, bool]] = []  # (characters encoded, on the loop's thread)
    encode, render = ct._encode, ct._renderer.render_plan
    rendered_on_loop: list[bool] = []

    def spy_encode(text: str) -> object:
        calls.append((len(text), threading.get_ident() == loop_thread))
        return encode(text)

    def spy_render(*args: Any, **kwargs: Any) -> Any:
        rendered_on_loop.append(threading.get_ident() == loop_thread)
        return render(*args, **kwargs)

    ct._encode = spy_encode  # type: ignore[method-assign]
    ct._renderer.render_plan = spy_render  # type: ignore[method-assign]
    text = corpus_text(random.Random(4), 80)
    first = (await ct.aencode_prompt(text)).tokens  # a miss: the whole text, on the executor
    results = [e.tokens for e in await asyncio.gather(*(ct.aencode_prompt(text + str(i)) for i in range(8)))]
    assert first == ct.encode_uncached(text)
    assert results == [ct.encode_uncached(text + str(i)) for i in range(8)]
    assert all(on_loop == (n <= limit) for n, on_loop in calls), calls
    assert any(on_loop for _, on_loop in calls) and any(not on_loop for _, on_loop in calls), calls
    assert ct.stats().hits >= 8
    assert (await ct.aencode_prompt("a short one")).tokens == ct.encode_uncached("a short one")
    assert calls[-1] == (len("a short one"), True)
    msgs = [{"role": "user", "content": text}]
    assert (await ct.aencode_chat_request(chat_body(msgs))).tokens == chat_ids(ct, msgs)
    assert rendered_on_loop[0] and rendered_on_loop[1]  # plain messages: rendered on the loop
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    rendered_on_loop.clear()
    assert (await ct.aencode_chat_request(chat_body(msgs, tools=tools))).tokens == chat_ids(
        ct, msgs, tools=tools
    )
    assert rendered_on_loop[0] is False  # tools: rendered on the executor
    assert (await ct.aencode_prompt([1, 2])).tokens == [1, 2]
    ct.close()


def test_memory_bound_holds_under_churn(dirs: dict[str, str]) -> None:
    cap = 60_000
    ct = CachedTokenizer.from_pretrained(
        dirs["metaspace"],
        config=CacheConfig(max_cache_bytes=cap, chunk_chars=32, margin_chars=8, overlap_chars=4),
    )
    rng = random.Random(6)
    base = corpus_text(rng, 120)
    for i in range(150):
        text = (base if i % 3 else corpus_text(rng, 80))[: rng.randrange(60, 700)] + corpus_text(rng, 4)
        assert ct.encode_prompt(text).tokens == ct.encode_uncached(text)
        assert ct.stats().bytes_held <= cap
    ct.check_invariants()
    st = ct.stats()
    assert st.evictions > 0 and st.entries > 0


def test_start_sensitivity_and_added_token_margin(dirs: dict[str, str]) -> None:
    def spec(name: str) -> dict[str, object]:
        return json.loads((Path(dirs[name]) / "tokenizer.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]

    assert not start_sensitive(spec("deepseek"))
    assert start_sensitive(spec("bytelevel")) and start_sensitive(spec("metaspace"))
    margin = AddedTokenMargin(spec("deepseek"))
    assert margin.length == 36 and not margin.always
    plain = "a plain sentence without any special token at its end, long enough"
    assert margin.extra(plain, len(plain)) == 0
    tagged = plain + "<｜end▁of"
    assert margin.extra(tagged, len(tagged)) == 36


async def test_event_loop_keeps_running_while_tokenizing(dirs: dict[str, str]) -> None:
    """The Rust work releases the GIL: the loop thread keeps ticking during a long encode."""
    ct = CachedTokenizer.from_pretrained(dirs["bytelevel"], config=TIGHT)
    text = corpus_text(random.Random(7), 20000)
    task = asyncio.ensure_future(ct.aencode_prompt(text))
    ticks = 0
    while not task.done():
        ticks += 1
        await asyncio.sleep(0)
    assert (await task).tokens == ct.encode_uncached(text)
    assert ticks > 20, ticks
    ct.close()


def test_pipeline_without_word_splits_stays_exact(dirs: dict[str, str], tmp_path: Path) -> None:
    """Metaspace with split=False: one word per piece, so no seam exists; every text is a miss."""
    spec = json.loads((Path(dirs["metaspace"]) / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"]["split"] = False
    d = tmp_path / "nosplit"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (d / "tokenizer_config.json").write_bytes(
        (Path(dirs["metaspace"]) / "tokenizer_config.json").read_bytes()
    )
    ct = CachedTokenizer.from_pretrained(str(d), config=TIGHT)
    rng = random.Random(8)
    base = corpus_text(rng, 60)
    for cut in range(0, len(base), 17):
        text = base[:cut] + corpus_text(rng, 3)
        assert ct.encode_prompt(text).tokens == ct.encode_uncached(text)
    assert ct.stats().hits == ct.stats().exact_hits


def test_a_registry_builds_through_its_loader_and_leaves_closing_to_it(dirs: dict[str, str]) -> None:
    calls: list[tuple[str, str | None]] = []
    keep: dict[tuple[str, str | None], CachedTokenizer] = {}

    def loader(
        path: str, template: str | None, model_id: str | None, reg: TokenizerRegistry
    ) -> CachedTokenizer:
        calls.append((path, template))
        return keep.setdefault((path, template), reg.load(path, template, model_id))

    first = TokenizerRegistry(dirs["bytelevel"], {"alias": dirs["bytelevel"]}, loader=loader)
    assert first.get() is first.get("alias") and calls == [(dirs["bytelevel"], None)]
    first.close()  # the loader's tokenizers are the loader's to close: still usable
    second = TokenizerRegistry(dirs["bytelevel"], loader=loader)
    assert second.get() is first.get() and second.get().encode_prompt("hi").tokens[0] == 0
    assert len(calls) == 2
