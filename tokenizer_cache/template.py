"""Chat templates: analysed like vLLM 0.33 analyses them, rendered like transformers 5.16-5.20 renders them.

vLLM 0.33 pins ``transformers>=5.16.1,<5.21``; later releases render differently (they drop message keys
whose value is null and copy ``reasoning`` to ``thinking``), so rendering is done here, with the
project's own Jinja environment, not by whatever ``transformers`` is installed.

``render``: a sandboxed environment built like transformers' (``trim_blocks``, ``lstrip_blocks``, loop
controls, ``{% generation %}``, ``tojson`` without HTML escaping, ``raise_exception``,
``strftime_now``), the tokenizer's named special tokens overridden by the template arguments, then
``messages``, ``tools``, ``documents`` and ``add_generation_prompt``; ``continue_final_message`` cuts the
text at a marker appended to the final message's content.

Analysis (vLLM's): ``detect_content_format`` ("openai" when some loop iterates a message's ``content``,
"string" otherwise or when vLLM's detector fails) and ``template_variables`` (the template's undeclared
variables).  Every rule, with its source: docs/parity.md, sections 4 and 5.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from .errors import ChatTemplateError

__all__ = ["TemplateCache", "detect_content_format", "template_variables"]

ContentFormatName = Literal["string", "openai"]
_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text (training masks); renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: object) -> None:
    raise jinja2.exceptions.TemplateError(message)  # type: ignore[arg-type]


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# -- vLLM's content-format detection ---------------------------------------------------------------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getattr) and "." in name:  # "ns.rest" names a namespace attribute
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _is_var(node.node, base)
    return False


def _is_item(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return _is_var(node.node, name) and isinstance(arg, jinja2.nodes.Const) and arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _reaches(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name[key]``), possibly filtered, tested or sliced."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reaches(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reaches(node.node, name, key)
    return _is_item(node, name, key) if key else _is_var(node, name)


def _dotted(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, jinja2.nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _aliases(root: jinja2.nodes.Template, name: str) -> list[str]:
    """``name`` and every name assigned from it (breadth first, as vLLM walks them)."""
    found, seen, todo = [name], {name}, deque([name])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = assign.target, assign.node
            if isinstance(lhs, jinja2.nodes.Name) and _reaches(rhs, current):
                found.append(lhs.name)
                if lhs.name != current and lhs.name not in seen:
                    seen.add(lhs.name)
                    todo.append(lhs.name)
            extra: list[str] = []
            if (
                isinstance(lhs, jinja2.nodes.Name)
                and isinstance(rhs, jinja2.nodes.Call)
                and isinstance(rhs.node, jinja2.nodes.Name)
                and rhs.node.name == "namespace"
            ):
                extra = [f"{lhs.name}.{kw.key}" for kw in rhs.kwargs if _reaches(kw.value, current)]
            elif isinstance(lhs, (jinja2.nodes.Getattr, jinja2.nodes.NSRef)) and _reaches(rhs, current):
                dotted = _dotted(lhs)
                extra = [dotted] if dotted is not None else []
            for alias in extra:
                found.append(alias)
                if alias != current and alias not in seen:
                    seen.add(alias)
                    todo.append(alias)
    return found


def _loop_name(loop: jinja2.nodes.For) -> str:
    if not isinstance(loop.target, jinja2.nodes.Name):
        raise ValueError("loop target is not a single name")  # vLLM's detector fails here
    return loop.target.name


def _content_loops(root: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    message_lists = _aliases(root, "messages")
    items = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_reaches(loop.iter, name) for name in message_lists):
            items.append(_loop_name(loop))
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_reaches(arg, m, "content") for m in items):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and any(_reaches(kw.value, m, "content") for m in items):
                    params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        it = loop.iter
        named = it.name if isinstance(it, jinja2.nodes.Name) else None
        if (
            any(_reaches(it, m, "content") for m in items)
            or (named is not None and named in params_by_loop.get(id(loop), ()))
            or (id(loop) not in in_macros and named == "content")
        ):
            _loop_name(loop)
            yield loop


def detect_content_format(template: str) -> ContentFormatName:
    """ "openai" if the template iterates a message's content parts, else "string" (see module doc)."""
    try:
        root = _environment().parse(template)
        next(_content_loops(root))
    except StopIteration:
        return "string"
    except Exception:  # vLLM falls back to "string" when its detector fails
        return "string"
    return "openai"


def template_variables(template: str) -> frozenset[str]:
    """Undeclared variables of the template (raises ``ChatTemplateError`` if it does not parse)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from e


# -- rendering -------------------------------------------------------------------------------------


class TemplateCache:
    """Compiled templates and their analysis, bounded; thread-safe."""

    def __init__(self, max_templates: int = 32) -> None:
        self._env = _environment()
        self._max = max_templates
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._formats: OrderedDict[str, ContentFormatName] = OrderedDict()
        self._variables: OrderedDict[str, frozenset[str]] = OrderedDict()

    def _get(self, table: OrderedDict[str, Any], key: str) -> Any:
        with self._lock:
            value = table.get(key)
            if value is not None:
                table.move_to_end(key)
            return value

    def _put(self, table: OrderedDict[str, Any], key: str, value: Any) -> None:
        with self._lock:
            table[key] = value
            while len(table) > self._max:
                table.popitem(last=False)

    def content_format(self, template: str) -> ContentFormatName:
        hit = self._get(self._formats, template)
        if hit is None:
            hit = detect_content_format(template)
            self._put(self._formats, template, hit)
        return hit

    def variables(self, template: str) -> frozenset[str]:
        hit = self._get(self._variables, template)
        if hit is None:
            hit = template_variables(template)
            self._put(self._variables, template, hit)
        return hit

    def compiled(self, template: str) -> jinja2.Template:
        hit = self._get(self._compiled, template)
        if hit is None:
            try:
                hit = self._env.from_string(template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the chat template does not parse: {e}") from e
            self._put(self._compiled, template, hit)
        return hit

    def render(
        self,
        template: str,
        messages: list[dict[str, Any]],
        *,
        tools: Any,
        documents: Any,
        add_generation_prompt: Any,
        continue_final_message: Any,
        variables: dict[str, Any],
    ) -> str:
        """The prompt text (raises ``ChatTemplateError`` for everything transformers raises)."""
        if not messages:
            raise ChatTemplateError("Cannot apply chat template to an empty conversation.")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible")
        _check_items(tools, "Tools should be JSON schemas (objects)")
        _check_items(documents, "Documents should be a list of dicts with 'title' and 'text' keys!")
        compiled = self.compiled(template)
        final = None
        if continue_final_message:
            messages, final = _mark_final(messages, continue_final_message, template)
        try:
            text = compiled.render(
                messages=messages,
                tools=None if tools is None else list(tools),
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # raise_exception(), undefined attributes, type errors inside the template
            raise ChatTemplateError(f"chat template error: {_reason(e)}") from e
        if final is not None:
            text = _cut_at_marker(text, final)
        return text


def _check_items(items: Any, message: str) -> None:
    """transformers iterates ``tools`` and ``documents`` and wants objects (from template arguments they
    can be anything)."""
    if items is None:
        return
    try:
        ok = all(isinstance(x, dict) for x in items)
    except TypeError:
        ok = False
    if not ok:
        raise ChatTemplateError(message)


def _reason(exc: BaseException) -> str:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return f"{type(exc).__name__}: {exc}"


def _mark_final(
    messages: list[dict[str, Any]], field: Any, template: str
) -> tuple[list[dict[str, Any]], str]:
    """A copy of the conversation with the marker appended to the final message's continued text."""
    key = field if isinstance(field, str) else "content"
    last = messages[-1]
    final = last.get(key)
    if final is None:
        raise ChatTemplateError(
            f'continue_final_message is set but the final message has no "{key}" to continue!'
        )
    if key not in template:
        raise ChatTemplateError(
            f'continue_final_message is set to "{key}" but this is not an accepted field in the chat_template'
        )
    last = dict(last)
    if isinstance(final, (list, tuple)):
        parts = [dict(p) if isinstance(p, dict) else p for p in final]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final = part["text"]
                if not isinstance(final, str):
                    raise ChatTemplateError("continue_final_message: the final text part is not a string")
                part["text"] = final + _TAG
                break
        else:
            raise ChatTemplateError(
                "continue_final_message is set but we could not find any text to continue"
            )
        last[key] = parts
    elif isinstance(final, str):
        last[key] = final + _TAG
    else:
        raise ChatTemplateError("continue_final_message: the final message's text is not a string")
    return [*messages[:-1], last], final


def _cut_at_marker(text: str, final: str) -> str:
    marker = _TAG.strip()
    if final.strip() not in text or marker not in text:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat after applying "
            "the chat template"
        )
    at = text.rindex(marker)
    if text[at : at + len(_TAG)] == _TAG:
        return text[:at]
    return text[:at].rstrip()
