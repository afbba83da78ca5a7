"""Check ``tokenizer_cache.request_schema`` against vLLM's own request model, on random messages.

Run with the python of the virtualenv that has vLLM (not the project's):

    /work/vllm/venv/bin/python tools/parity_schema_check.py [--seed N] [--count N]

Each random message (valid and broken shapes: every role, content as text, parts of every kind, null,
objects; names, tool call ids, tool calls of every shape, reasoning, extra keys) is validated by vLLM's
``ChatCompletionRequest`` (pydantic) and by ``request_schema``; the outcomes (accepted or refused, and the
validated message with content and tool calls read, nested key order included) must be equal.  The
project's modules are loaded by file path: this virtualenv does not have the project installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import types
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1] / "tokenizer_cache"


def _load_schema() -> Any:
    pkg = types.ModuleType("tokenizer_cache")
    pkg.__path__ = [str(PACKAGE)]
    sys.modules["tokenizer_cache"] = pkg
    for name in ("errors", "typed_dicts", "request_schema"):
        spec = importlib.util.spec_from_file_location(f"tokenizer_cache.{name}", PACKAGE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["tokenizer_cache.request_schema"]


def _canonical(message: dict[str, Any]) -> str:
    """The message with its top-level keys sorted (vLLM rebuilds messages) and nested order kept."""
    return json.dumps({k: json.dumps(v, default=str) for k, v in sorted(message.items())})


def vllm_outcome(message: Any) -> str | None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        validated = ChatCompletionRequest.model_validate({"model": "m", "messages": [message]}).messages[0]
        if not isinstance(validated, dict):
            return "not a dict"
        out = dict(validated)
        if out.get("content") is not None and not isinstance(out["content"], (str, list)):
            out["content"] = list(out["content"])  # vLLM reads lazily validated content: errors are 400s
        return _canonical(out)
    except Exception:
        return None


def our_outcome(schema: Any, message: Any) -> str | None:
    try:
        out = schema.validate_messages([message])[0]
        if isinstance(out.get("content"), schema.LazyParts):
            out["content"] = schema.materialize(out["content"], "content")
        return _canonical(out)
    except Exception as e:
        if type(e).__name__ != "RequestValidationError":
            raise
        return None


class _Messages:
    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def part(self) -> Any:
        return self.r.choice(
            [
                "plain",
                {"type": "text", "text": "t"},
                {"text": "t", "type": "text", "cache_control": {"type": "ephemeral"}},
                {"type": "input_text", "text": "i"},
                {"type": "output_text", "text": "o"},
                {"type": "refusal", "refusal": "r"},
                {"type": "thinking", "thinking": "th"},
                {"type": "thinking", "thinking": "th", "closed": self.r.choice([True, 1, "yes", 5])},
                {"type": "text"},
                {"type": "text", "text": None},
                {"text": "no type"},
                {"type": "tool_reference", "name": "tr"},
                {"type": "image_url", "image_url": {"url": "http://x"}},
                5,
                {"type": "text", "text": "u", "uuid": "id"},
                {"type": "weird"},
            ]
        )

    def call(self) -> Any:
        ok = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        return self.r.choice(
            [
                ok,
                {"type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}},
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                {"id": "c", "function": {"name": "f", "arguments": "{}"}},
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "f", "arguments": "{}", "x": 1},
                    "index": 0,
                },
                "str",
                {"id": "c", "type": "function", "function": {"arguments": "[]", "name": "g"}},
            ]
        )

    def message(self) -> dict[str, Any]:
        r = self.r
        m: dict[str, Any] = {
            "role": r.choice(["user", "system", "assistant", "tool", "developer", "function", "x", 5])
        }
        shape = r.randrange(6)
        if shape == 0:
            m["content"] = "hello"
        elif shape in (1, 5):
            m["content"] = [self.part() for _ in range(r.randrange(4) if shape == 1 else 1)]
        elif shape == 2:
            m["content"] = None
        elif shape == 4:
            m["content"] = {"type": "text", "text": "d"}
        extras = {
            "name": lambda: r.choice(["n", 5, None]),
            "tool_call_id": lambda: r.choice(["t", None, 3]),
            "tool_calls": lambda: r.choice(
                [[self.call() for _ in range(r.randrange(3))], None, {"a": 1}, "xy"]
            ),
            "reasoning": lambda: r.choice(["r", None, 5]),
            "reasoning_content": lambda: r.choice(["rc", None]),
            "refusal": lambda: r.choice(["no", None]),
            "task": lambda: r.choice(["t", None, 1]),
            "tools": lambda: r.choice(
                [[{"type": "function", "function": {"name": "f"}}], None, [{"function": {}}]]
            ),
            "extra": lambda: 1,
            "audio": lambda: r.choice([{"id": "a"}, None, {}]),
        }
        for key, make in extras.items():
            if r.random() < 0.2:
                m[key] = make()
        return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=5000)
    args = ap.parse_args()
    schema = _load_schema()
    gen = _Messages(args.seed)
    mismatches = 0
    for _ in range(args.count):
        message = gen.message()
        want, got = vllm_outcome(message), our_outcome(schema, message)
        if want != got:
            mismatches += 1
            if mismatches <= 10:
                print(f"differs: {json.dumps(message)}\n  vLLM: {want}\n  ours: {got}")
    print(f"{args.count} random messages, {mismatches} differ from vLLM's request model")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
