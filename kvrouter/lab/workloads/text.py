"""Deterministic synthetic text, for the live path (real HTTP through a real tokenizer).

A segment's text is ``length`` words drawn from the built-in word list by the segment's own stream (the
same ``(key, position)`` function as its token ids, with the list size as the vocabulary), so equal keys
give equal text and a shared segment is a shared string prefix.  The 520 words are common lower-case
English words, each a single token with its leading space in the DeepSeek V3 tokenizer (checked by the
tests) and, being common, in most BPE vocabularies: one word is about one token, and ``materialize``
gives the exact counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrouter.lab.workloads.spec import ChatMessage, Role, Segment, TokenSpace
from kvrouter.lab.workloads.tokens import stream_tokens

# fmt: off
WORDS: tuple[str, ...] = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
    "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week",
    "company", "system", "program", "question", "work", "government", "number", "night", "point", "home",
    "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book",
    "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend",
    "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name",
    "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face",
    "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result",
    "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force",
    "education", "foot", "boy", "age", "policy", "process", "music", "market", "sense", "nation", "plan",
    "college", "interest", "death", "experience", "effect", "use", "class", "control", "care", "field",
    "development", "role", "effort", "rate", "heart", "drug", "show", "leader", "light", "voice", "wife",
    "police", "mind", "price", "report", "decision", "son", "view", "relationship", "town", "road", "arm",
    "difference", "value", "building", "action", "model", "season", "society", "tax", "director",
    "position", "player", "record", "paper", "space", "ground", "form", "event", "official", "matter",
    "center", "couple", "site", "project", "activity", "star", "table", "need", "court", "oil",
    "situation", "cost", "industry", "figure", "street", "image", "phone", "data", "picture", "practice",
    "piece", "land", "product", "doctor", "wall", "patient", "worker", "news", "test", "movie", "north",
    "love", "support", "technology", "step", "baby", "computer", "type", "attention", "film", "tree",
    "source", "organization", "hair", "window", "evidence", "population", "island", "training", "top",
    "bank", "goal", "rule", "winter", "plant", "energy", "chair", "bed", "floor", "letter", "box", "page",
    "thought", "trade", "river", "summer", "truth", "stone", "garden", "song", "dog", "cat", "fish", "bird",
    "red", "blue", "green", "black", "white", "small", "large", "long", "short", "high", "low", "young",
    "old", "new", "good", "great", "little", "big", "different", "important", "public", "able", "early",
    "late", "hard", "major", "better", "best", "free", "strong", "true", "whole", "clear", "real",
    "local", "recent", "simple", "open", "full", "special", "easy", "certain", "personal", "close",
    "common", "poor", "natural", "significant", "similar", "hot", "dead", "central", "happy", "serious",
    "ready", "left", "physical", "general", "environmental", "financial", "glass", "democratic", "dark",
    "various", "entire", "legal", "private", "past", "foreign", "fine", "medical", "final", "main",
    "ocean", "nice", "huge", "popular", "traditional", "cultural", "say", "make", "go", "know", "take",
    "see", "come", "think", "look", "want", "give", "find", "tell", "ask", "seem", "feel", "try", "leave",
    "call", "keep", "let", "begin", "help", "talk", "turn", "start", "might", "wind", "hear", "play",
    "run", "move", "like", "live", "believe", "hold", "bring", "happen", "write", "provide", "sit",
    "stand", "lose", "pay", "meet", "include", "continue", "set", "learn", "lead", "understand", "watch",
    "follow", "stop", "create", "speak", "read", "allow", "add", "spend", "grow", "offer", "remember",
    "consider", "appear", "buy", "wait", "serve", "die", "send", "expect", "build", "stay", "fall",
    "cut", "reach", "kill", "remain", "suggest", "raise", "pass", "sell", "require", "decide", "return",
    "explain", "hope", "develop", "carry", "break", "receive", "agree", "hit", "produce", "eat", "cover",
    "catch", "draw", "choose", "also", "very", "often", "however", "too", "usually", "really", "later",
    "never", "always", "sometimes", "together", "likely", "simply", "generally", "instead", "actually",
    "again", "rather", "almost", "especially", "ever", "quickly", "probably", "already", "below",
    "directly", "therefore", "else", "thus", "easily", "eventually", "exactly", "certainly", "normally",
    "currently", "extremely", "finally", "constantly", "properly", "soon", "specifically", "ahead",
    "daily", "highly", "immediately", "relatively", "slowly", "fairly", "primarily", "completely",
    "ultimately", "widely", "recently", "seriously", "frequently", "fully", "mostly", "naturally",
    "nearly", "occasionally", "carefully", "clearly", "essentially", "possibly", "slightly", "somewhat",
    "equally", "greatly", "necessarily", "personally", "rarely", "regularly", "similarly", "basically",
    "closely", "effectively", "initially", "literally", "mainly", "merely", "gently", "hopefully",
    "originally", "roughly", "significantly", "totally", "twice", "elsewhere", "everywhere", "perfectly",
    "physically", "suddenly", "truly", "virtually", "altogether", "anyway", "automatically", "deeply",
    "definitely", "deliberately", "hardly", "readily", "terribly", "unfortunately", "forth", "briefly",
)
# fmt: on

_WORD_SPACE = TokenSpace(vocab_size=len(WORDS), low=0)
_WORD_SALT = 0x5EED_7E47_0000_0001  # words and token ids of one key come from unrelated streams


def segment_text(segment: Segment) -> str:
    """The segment's ``length`` words, space-separated."""
    if segment.length == 0:
        return ""
    idx = stream_tokens(_WORD_SPACE, segment.key ^ _WORD_SALT, segment.length)
    return " ".join(np.asarray(WORDS, dtype=object)[idx].tolist())


class TextCache:
    """Memoises ``segment_text`` for one generation run (a 6000-word system prompt is built once)."""

    def __init__(self) -> None:
        self._texts: dict[Segment, str] = {}

    def __call__(self, segment: Segment) -> str:
        text = self._texts.get(segment)
        if text is None:
            text = self._texts[segment] = segment_text(segment)
        return text


def render_text(parts: Sequence[tuple[Role, Segment]], texts: TextCache, sep: str = "\n\n") -> str:
    """A completion prompt: the parts' texts joined by ``sep``."""
    return sep.join(texts(seg) for _, seg in parts)


def render_messages(
    parts: Sequence[tuple[Role, Segment]], texts: TextCache, sep: str = "\n\n"
) -> tuple[ChatMessage, ...]:
    """Chat messages: consecutive parts of one role merge into one message, joined by ``sep``."""
    messages: list[ChatMessage] = []
    run: list[str] = []
    role: Role | None = None
    for r, seg in parts:
        if r != role and role is not None:
            messages.append(ChatMessage(role, sep.join(run)))
            run = []
        role = r
        run.append(texts(seg))
    if role is not None:
        messages.append(ChatMessage(role, sep.join(run)))
    return tuple(messages)
