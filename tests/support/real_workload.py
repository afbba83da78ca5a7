"""An agent-like request sequence for the real-vLLM tier: chats over a few shared system prompts with
growing histories, tools rendered into the prompt (``tool_choice: "none"``), assistant tool calls and tool
results, and some plain completions.  Seeded; the assistant turns of the history are written here (a
random-weight model's answers are noise), so a run's token ids depend on the seed alone."""

from __future__ import annotations

import json
import random
from typing import Any

from tests.support.real_vllm import MODEL

WORDS = (  # noqa: SIM905 - a sentence reads better than a list
    "cache block prefix router engine token request answer question system prompt history tool call result "
    "weather city temperature forecast order invoice customer account balance transfer report summary table "
    "index shard replica latency throughput batch queue worker thread kernel memory page layer model adapter "
    "alpha beta gamma delta north south east west river mountain forest garden window door street bridge "
    "yellow purple orange silver golden quiet rapid gentle sharp bright early later often never always"
).split()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "An order by its id",
            "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        },
    },
]


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class AgentWorkload:
    """``calls(n)``: (route, body) pairs.  Sessions pick one of ``systems`` shared system prompts and grow
    until their history nears ``max_words``, then start over."""

    def __init__(
        self,
        seed: int = 0,
        *,
        systems: int = 5,
        system_words: int = 300,
        sessions: int = 8,
        max_words: int = 1300,
        max_tokens: int = 4,
    ) -> None:
        self.rng = random.Random(seed)
        self.systems = [
            f"You are agent {i}. " + text(random.Random(seed * 1000 + i), system_words)
            for i in range(systems)
        ]
        self.n_sessions = sessions
        self.max_words = max_words
        self.max_tokens = max_tokens
        self.sessions: list[list[dict[str, Any]]] = [self._new() for _ in range(sessions)]

    def _new(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.rng.choice(self.systems)}]

    def _words(self, msgs: list[dict[str, Any]]) -> int:
        return sum(len(str(m.get("content") or "").split()) + 20 for m in msgs)

    def _turn(self, msgs: list[dict[str, Any]]) -> None:
        """Add the answer to the last user turn (sometimes via a tool call and its result)."""
        r = self.rng
        if r.random() < 0.35:
            call_id = f"call_{r.randrange(10**6)}"
            msgs.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": json.dumps({"city": r.choice(WORDS), "unit": "c"}),
                            },
                        }
                    ],
                }
            )
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": text(r, 25)})
        msgs.append({"role": "assistant", "content": text(r, r.randrange(10, 40))})

    def next_call(self) -> tuple[str, dict[str, Any]]:
        r = self.rng
        if r.random() < 0.15:
            prompt = r.choice(self.systems) + "\n\nQuestion: " + text(r, r.randrange(20, 120))
            return "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens}
        i = r.randrange(self.n_sessions)
        msgs = self.sessions[i]
        if self._words(msgs) > self.max_words:
            msgs = self.sessions[i] = self._new()
        elif len(msgs) > 1:
            self._turn(msgs)
        msgs.append({"role": "user", "content": text(r, r.randrange(15, 80))})
        body: dict[str, Any] = {"model": MODEL, "messages": list(msgs), "max_tokens": self.max_tokens}
        if r.random() < 0.5 or any(m.get("tool_calls") for m in msgs):
            body["tools"] = TOOLS
            body["tool_choice"] = "none"
        return "/v1/chat/completions", body

    def calls(self, n: int) -> list[tuple[str, dict[str, Any]]]:
        return [self.next_call() for _ in range(n)]
