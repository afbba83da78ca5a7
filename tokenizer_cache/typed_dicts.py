"""pydantic's validation of TypedDict unions, reproduced for the request shapes vLLM declares.

vLLM validates requests with pydantic models whose TypedDicts allow extra keys; the outcome of a union of
TypedDicts is decided by pydantic-core's "smart" mode, which these nodes reproduce:

- a TypedDict validates when its required keys are present and every declared key it finds fits; its
  output lists the declared keys first (in declaration order), then the extra keys (in input order);
- a union tries every member; an exact match that sets no fields (a string, a null) wins at once;
  otherwise the member that *sets the most declared fields* wins, counting the fields its nested
  TypedDicts set when they are validated eagerly (``list`` items, object fields); ties go to the earlier
  member;
- ``Iterable`` fields are not validated until they are read: ``IterableOf`` returns ``LazyParts``.

JSON inputs only ever validate "exactly" here (no member is preferred for strictness), except the lax
conversions pydantic applies to booleans and integers (``lax_bool``, ``lax_int``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TD",
    "AnyValue",
    "Bool",
    "ByRole",
    "DictOf",
    "Invalid",
    "IterableOf",
    "LazyParts",
    "ListOf",
    "Lit",
    "Node",
    "Null",
    "OneOf",
    "Str",
    "is_object",
    "lax_bool",
    "lax_int",
    "optional",
]


class Invalid(Exception):
    """A value does not fit a schema (internal; turned into ``RequestValidationError``)."""


# -- schema nodes: (validate(value) -> (output, fields_set_count or None)) ---------------------------


class Node:
    def check(self, value: Any) -> tuple[Any, int | None]:
        raise NotImplementedError


class Str(Node):
    def check(self, value: Any) -> tuple[Any, int | None]:
        if type(value) is not str:
            raise Invalid("a string")
        return value, None


class Bool(Node):
    """pydantic's lax bool: booleans, 0/1, and the usual words."""

    _WORDS = {"1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}
    _WORDS.update({"0": False, "off": False, "f": False, "false": False, "n": False, "no": False})

    def check(self, value: Any) -> tuple[Any, int | None]:
        return lax_bool(value), None


class AnyValue(Node):
    def check(self, value: Any) -> tuple[Any, int | None]:
        return value, None


class Null(Node):
    def check(self, value: Any) -> tuple[Any, int | None]:
        if value is not None:
            raise Invalid("null")
        return None, None


@dataclass(frozen=True)
class Lit(Node):
    values: tuple[str, ...]

    def check(self, value: Any) -> tuple[Any, int | None]:
        if type(value) is not str or value not in self.values:
            raise Invalid(f"one of {list(self.values)}")
        return value, None


@dataclass(frozen=True)
class DictOf(Node):
    """``dict[str, X]``."""

    value: Node

    def check(self, value: Any) -> tuple[Any, int | None]:
        if not isinstance(value, Mapping):
            raise Invalid("an object")
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise Invalid("string keys")
            out[k] = self.value.check(v)[0]
        return out, None


@dataclass(frozen=True)
class ListOf(Node):
    item: Node

    def check(self, value: Any) -> tuple[Any, int | None]:
        if type(value) is not list:
            raise Invalid("an array")
        out, total = [], None
        for v in value:
            o, n = self.item.check(v)
            out.append(o)
            if n is not None:
                total = (total or 0) + n
        return out, total


@dataclass
class LazyParts:
    """Content kept as given, validated item by item (against ``item``) only when vLLM reads it."""

    items: list[Any]
    item: Node


@dataclass(frozen=True)
class IterableOf(Node):
    item: Node

    def check(self, value: Any) -> tuple[Any, int | None]:
        if isinstance(value, (list, tuple)):
            return LazyParts(list(value), self.item), None
        if isinstance(value, (str, Mapping)):  # iterable in Python: characters, keys
            return LazyParts(list(value), self.item), None
        raise Invalid("an iterable")


_NOT_OBJECTS: frozenset[type] = frozenset({str, list, int, float, bool, type(None)})
"""JSON value types that are never objects (``is_object`` is false for them without an ABC check)."""


@dataclass(frozen=True)
class OneOf(Node):
    """A union in pydantic's smart mode (module docstring).

    Members a value's tags rule out (``TD.rejects``: not an object, or a required literal such as
    ``type`` that differs) are not tried.  Which remain depends only on the value's tag strings, so the
    candidates are found once per combination of tag values the members declare (a string no member
    declares counts as absent: every member requiring that tag rejects both), in member order.  A value
    no candidate takes is walked again over every member, so its error names every member's reason as
    ``check_all`` (the reference the dispatch is held to) does.

    ``common``: the outcome of the union's commonest values, decided without trying the members (None:
    not such a value); it must give exactly what ``check_all`` gives for every value it answers."""

    choices: tuple[Node, ...]
    common: Callable[[Any], tuple[Any, int | None] | None] | None = None

    def __post_init__(self) -> None:
        known: dict[str, set[str]] = {}
        for c in self.choices:
            if isinstance(c, TD):
                for key, values in c.tags:
                    known.setdefault(key, set()).update(values)
        tags = tuple((k, frozenset(v)) for k, v in known.items())
        object.__setattr__(self, "_tags", tags)
        scalar = tuple(c for c in self.choices if not isinstance(c, TD))
        # Per JSON scalar type, the members that may take it (a string is no null, None no string).
        object.__setattr__(
            self, "_scalar", {t: tuple(c for c in scalar if _may_take(c, t)) for t in _NOT_OBJECTS}
        )
        # Bounded: at most one entry per combination of the members' own literal values.
        object.__setattr__(self, "_by_tags", {})

    def _candidates(self, value: Any) -> tuple[Node, ...]:
        t = type(value)
        if t is not dict:
            if t in _NOT_OBJECTS:
                return self._scalar[t]  # type: ignore[attr-defined]
            if not isinstance(value, Mapping):
                return tuple(c for c in self.choices if not isinstance(c, TD))
        key = tuple(
            tag if type(tag := value.get(k)) is str and tag in known else None
            for k, known in self._tags  # type: ignore[attr-defined]
        )
        by_tags: dict[tuple[str | None, ...], tuple[Node, ...]] = self._by_tags  # type: ignore[attr-defined]
        found = by_tags.get(key)
        if found is None:
            found = tuple(c for c in self.choices if not isinstance(c, TD) or c.rejects(value) is None)
            by_tags[key] = found
        return found

    def check(self, value: Any) -> tuple[Any, int | None]:
        if self.common is not None and (got := self.common(value)) is not None:
            return got
        try:
            return self._walk(self._candidates(value), value, screened=True)
        except Invalid:
            return self.check_all(value)  # raises, with every member's reason

    def check_all(self, value: Any) -> tuple[Any, int | None]:
        """Every member tried in order (no dispatch)."""
        return self._walk(self.choices, value, screened=False)

    def _walk(self, choices: tuple[Node, ...], value: Any, *, screened: bool) -> tuple[Any, int | None]:
        """``screened``: ``choices`` holds only members whose ``rejects`` passed for ``value``."""
        best: tuple[Any, int | None] | None = None
        reasons: list[Any] = []
        for choice in choices:
            if isinstance(choice, TD):
                if not screened and (why := choice.rejects(value)) is not None:
                    reasons.append(why)  # a cheap first look: not an object, or a tag that differs
                    continue
                if (
                    best is not None
                    and best[1] is not None
                    and choice.flat
                    and best[1] >= choice.bound(value)
                ):
                    continue  # it cannot set more fields than the best so far, and ties go to the earlier

            try:
                out, n = choice.check(value)
            except Invalid as e:
                reasons.append(e)
                continue
            if n is None and best is None:
                return out, n  # an exact match that sets no fields wins at once
            if best is None or (best[1] is not None and n is not None and n > best[1]):
                best = (out, n)
        if best is None:
            raise Invalid(" or ".join(dict.fromkeys(map(str, reasons))))
        return best


def _may_take(node: Node, t: type) -> bool:
    """False when ``node`` refuses every value of type ``t`` whatever it is."""
    if isinstance(node, (Str, Lit)):
        return t is str
    if isinstance(node, Null):
        return t is type(None)
    return True


def _nests(node: Node) -> bool:
    if isinstance(node, TD):
        return True
    if isinstance(node, OneOf):
        return any(_nests(c) for c in node.choices)
    if isinstance(node, (ListOf, DictOf)):
        return _nests(node.item if isinstance(node, ListOf) else node.value)
    return False


def is_object(value: Any) -> bool:
    t = type(value)
    return t is dict or (t not in _NOT_OBJECTS and isinstance(value, Mapping))


class TD(Node):
    """A TypedDict in a model that allows extra keys."""

    def __init__(self, name: str, fields: tuple[tuple[str, Node, bool], ...]) -> None:
        self.name = name
        self.fields = fields
        self.declared = frozenset(f[0] for f in fields)
        # Required literal fields ("role", "type"): checked first, without building anything.
        self.tags = tuple((k, n.values) for k, n, req in fields if req and isinstance(n, Lit))
        # No nested TypedDict: the fields it sets are at most the declared keys present.
        self.flat = not any(_nests(n) for _, n, _ in fields)

    def bound(self, value: Mapping[str, Any]) -> int:
        return sum(1 for k in self.declared if k in value)

    def rejects(self, value: Any) -> str | None:
        """Why ``value`` cannot be this type, found cheaply (None: it may be)."""
        if not is_object(value):
            return f"an object ({self.name})"
        for key, values in self.tags:
            tag = value.get(key)
            if type(tag) is not str or tag not in values:
                return f"{self.name}.{key} in {list(values)}"
        return None

    def check(self, value: Any) -> tuple[Any, int | None]:
        if not is_object(value):
            raise Invalid(f"an object ({self.name})")
        out: dict[str, Any] = {}
        count = 0
        for key, node, required in self.fields:
            if key in value:
                try:
                    out[key], nested = node.check(value[key])
                except Invalid as e:
                    raise Invalid(f"{self.name}.{key}: {e}") from None
                count += 1 + (nested or 0)
            elif required:
                raise Invalid(f"{self.name}.{key} is required")
        declared = self.declared
        for k, v in value.items():
            if k not in declared:
                out[k] = v
        return out, count


class ByRole(Node):
    """The message union: the OpenAI member whose ``role`` literal matches (at most one does), then vLLM's
    catch-all member, in that order; the other members fail on their role, so they are not tried."""

    def __init__(self, openai: tuple[TD, ...], custom: TD) -> None:
        self.by_role = {
            v: OneOf((td, custom)) for td in openai for k, vals in td.tags if k == "role" for v in vals
        }
        self.custom_only = OneOf((custom,))

    def check(self, value: Any) -> tuple[Any, int | None]:
        role = value.get("role") if is_object(value) else None
        return (
            self.by_role.get(role, self.custom_only).check(value)
            if type(role) is str
            else self.custom_only.check(value)
        )


def optional(node: Node) -> Node:
    return OneOf((node, Null()))


def lax_bool(value: Any) -> bool:
    if type(value) is bool:
        return value
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    if type(value) is str and value.strip().lower() in Bool._WORDS:
        return Bool._WORDS[value.strip().lower()]
    raise Invalid("a boolean")


def lax_int(value: Any) -> int:
    """pydantic's lax int: integers (and booleans), integral floats, numeric strings."""
    if type(value) in (int, bool):
        return int(value)
    if type(value) is float and value.is_integer():
        return int(value)
    if type(value) is str:
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise Invalid("an integer")
