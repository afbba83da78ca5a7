"""docs/configuration.md, generated from the fleet file's config structs (``RouterFleetConfig`` and every
struct it holds): each key with its type, default and the docstring written under the field, so the
reference cannot drift from the code.

    python tools/config_reference.py            # write docs/configuration.md
    python tools/config_reference.py --check    # exit 1 if the file differs from what the code says
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvrouter.config import RouterFleetConfig  # noqa: E402

OUT = ROOT / "docs" / "configuration.md"

HEADER = """# Configuration reference

Every key of the fleet file (`kvrouter serve|epp|indexer|check --fleet F`), generated from the config
structs by `tools/config_reference.py` (a test fails when this file and the code disagree: edit the
docstring under the field, then run the tool).  A misspelt key is refused with its path and the nearest
valid name.  Sections follow the file's nesting; a key without a description is described by its section.
"""


def _field_docs(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """Docstrings written under each field, and each field's annotation as written, over the MRO."""
    docs: dict[str, str] = {}
    annots: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, msgspec.Struct) or not issubclass(klass, msgspec.Struct):
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(src).body[0]
        assert isinstance(body, ast.ClassDef)
        stmts = body.body
        for i, st in enumerate(stmts):
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                name = st.target.id
                annots[name] = ast.unparse(st.annotation)
                nxt = stmts[i + 1] if i + 1 < len(stmts) else None
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[name] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs, annots


def _structs_in(tp: Any) -> list[type]:
    """Struct types a field's type holds (directly, in a union, a list or a dict's values)."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return [tp]
    out: list[type] = []
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType, list, dict, tuple):
        args = typing.get_args(tp)
        for a in args[1:] if origin is dict else args:
            out.extend(_structs_in(a))
    return out


def _default(f: msgspec.structs.FieldInfo) -> str:
    if f.default is not msgspec.NODEFAULT:
        d = f.default
    elif f.default_factory is not msgspec.NODEFAULT:
        d = f.default_factory()
    else:
        return "(required)"
    if isinstance(d, msgspec.Struct):
        return "(section)"
    text = msgspec.json.encode(msgspec.to_builtins(d)).decode()
    return f"`{text}`" if len(text) <= 40 else "(see description)"


def _md(s: str) -> str:
    return s.replace("``", "`").replace("|", "\\|")


def render() -> str:
    parts = [HEADER]
    seen: set[type] = set()
    queue: list[tuple[str, type]] = [("(top level)", RouterFleetConfig)]
    while queue:
        path, cls = queue.pop(0)
        if cls in seen:
            parts.append(f"\n## `{path}`\n\nThe same keys as `{cls.__name__}` above.\n")
            continue
        seen.add(cls)
        docs, annots = _field_docs(cls)
        class_doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split())
        parts.append(f"\n## `{path}`\n")
        if class_doc and not class_doc.startswith(cls.__name__ + "("):
            parts.append(f"\n{class_doc}\n")
        parts.append("\n| key | type | default | description |\n|---|---|---|---|\n")
        hints = typing.get_type_hints(cls)
        for f in msgspec.structs.fields(cls):
            name = f.encode_name
            parts.append(
                f"| `{name}` | `{_md(annots.get(f.name, str(f.type)))}` | {_md(_default(f))} "
                f"| {_md(docs.get(f.name, ''))} |\n"
            )
            for sub in _structs_in(hints.get(f.name, f.type)):
                origin = typing.get_origin(hints.get(f.name))
                key = f"{name}[]" if origin is list else (f"{name}.<name>" if origin is dict else name)
                prefix = "" if path == "(top level)" else path + "."
                queue.append((prefix + key, sub))
    return "".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python tools/config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
