"""Chat templates: a model's Jinja template rendered in a sandbox, the way transformers does.

The environment is transformers' (``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, a ``{% generation %}`` block that just renders
its body, the ``raise_exception`` and ``strftime_now`` globals and a ``tojson`` filter that does
not escape HTML or non-ASCII), so a template renders here exactly as in
``AutoTokenizer.apply_chat_template(..., tokenize=False)``. Each template source is compiled
once. Messages are checked and normalised the way vLLM's chat front end does with its
``"string"`` content format (a list of text parts is joined with newlines; ``None`` is ``""``).

Every rendering has a budget (:mod:`.template_sandbox`): :data:`RENDER_BUDGET` seconds and
at most ``max_chars`` characters of output (:data:`MAX_RENDERED_CHARS` unless the caller gives
a bound), enforced inside the rendering so a runaway template stops using the CPU; it fails
with a :class:`~.template_sandbox.RenderLimitError` (a :class:`ChatTemplateError`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro

from ..errors import ChatTemplateError, InvalidRequestError
from .template_sandbox import BudgetedEnvironment, RenderLimitError, budget

#: The message roles accepted (what the template makes of them is the template's business).
ROLES: Final = ("system", "developer", "user", "assistant", "tool")
#: How many compiled templates are kept.
CACHE_SIZE: Final = 32
#: Seconds one rendering may take before it is stopped (a model's template takes
#: milliseconds; a runaway one is stopped within one loop iteration past this).
RENDER_BUDGET: Final = 1.0
#: The most characters one rendering may produce unless the caller gives a smaller bound
#: (the text layer gives the context's character bound), and the largest string or list
#: it may build on the way.
MAX_RENDERED_CHARS: Final = 1 << 24
_TEMPLATE_FILENAME: Final = "<template>"
_SHOWN_SOURCE: Final = 120


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): the
    body is rendered as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads the class attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("render_body"), [], [], body).set_lineno(lineno)

    def render_body(self, caller: Macro) -> str:
        return str(caller())


def raise_exception(message: str) -> None:
    """The template global a template calls to refuse its input."""
    raise jinja2.TemplateError(message)


def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter: :func:`json.dumps` without HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    """The template global giving the local time, formatted."""
    return datetime.now().strftime(format)


def _environment() -> BudgetedEnvironment:
    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


_ENVIRONMENT: Final = _environment()


def _source_line(source: str, line: int | None) -> str:
    lines = source.splitlines()
    if line is None or not 1 <= line <= len(lines):
        return ""
    text = lines[line - 1].strip()
    if len(text) > _SHOWN_SOURCE:
        text = text[:_SHOWN_SOURCE - 3] + "..."
    return f" ({text})" if text else ""


@functools.lru_cache(maxsize=CACHE_SIZE)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source).

    Raises:
        ChatTemplateError: the template does not parse (names the line).
    """
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template syntax error at line {exc.lineno}"
            f"{_source_line(source, exc.lineno)}: {exc.message}", line=exc.lineno) from None


def _template_line(exc: BaseException) -> int | None:
    """The innermost template line in ``exc``'s traceback (jinja maps frames to lines)."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _TEMPLATE_FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool, variables: Mapping[str, Any],
                         max_chars: int | None = None, seconds: float | None = None) -> str:
    """Render ``source`` with ``messages`` (already normalised) and template ``variables``,
    within the budget (``seconds``, default :data:`RENDER_BUDGET`; ``max_chars`` characters
    of output, default :data:`MAX_RENDERED_CHARS`).

    ``variables`` are what transformers passes besides the messages: the special tokens
    (``bos_token``, ...) and the caller's extra keyword arguments; ``tools`` and
    ``documents`` default to None. A template that does not name the ``developer`` role
    gets developer messages as system ones, as vLLM gives them (:func:`developer_as_system`).

    Raises:
        ChatTemplateError: the template does not parse, or raised while rendering (calling
            ``raise_exception`` or failing otherwise); names the template line.
        RenderLimitError: (a ChatTemplateError) the rendering took longer than its budget
            (``kind`` ``"time"``), or its output (``"output"``) or a value it built
            (``"value"``) is larger than allowed; it was stopped and its result dropped.
    """
    template = compile_template(source)
    messages = developer_as_system(source, messages)
    variables = dict(variables)
    continue_final = bool(variables.pop("continue_final_message", False))
    context = {"tools": None, "documents": None, **variables, "messages": messages,
               "add_generation_prompt": add_generation_prompt}
    limit = MAX_RENDERED_CHARS if max_chars is None else min(max_chars, MAX_RENDERED_CHARS)
    try:
        with budget(RENDER_BUDGET if seconds is None else seconds, limit,
                    MAX_RENDERED_CHARS) as check_output:
            parts = []
            size = 0
            for chunk in template.generate(context):
                size += len(chunk)
                check_output(size)
                parts.append(chunk)
            check_output(size)  # a result that came after the deadline is dropped
            rendered = "".join(parts)
    except RenderLimitError:
        raise
    except Exception as exc:
        raise _render_error(source, exc) from exc
    return _continue_final(rendered, messages) if continue_final else rendered


def developer_as_system(source: str, messages: Sequence[Mapping[str, Any]]
                        ) -> Sequence[Mapping[str, Any]]:
    """``messages`` as vLLM's ``safe_apply_chat_template`` gives them to a template
    (``source``) that does not name the ``developer`` role (no ``'developer'`` or
    ``"developer"`` in it): each developer message a system one, and then, when a system
    message is not first or there are several, all system messages merged into one first
    (their non-empty contents joined by a blank line). Other messages, and templates that
    name the role, are left as they are."""
    if (not any(m.get("role") == "developer" for m in messages)
            or "'developer'" in source or '"developer"' in source):
        return messages
    converted = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
                 if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m.get("role") == "system"]
    if not systems or systems == [0]:
        return converted
    contents = [str(converted[i].get("content") or "") for i in systems]
    merged = {"role": "system", "content": "\n\n".join(c for c in contents if c)}
    return [merged, *(m for m in converted if m.get("role") != "system")]


def _continue_final(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``rendered`` cut after the last message's content (transformers'
    ``continue_final_message``): the model goes on with that message, no end of turn."""
    final = messages[-1].get("content") if messages else None
    text = final.strip() if isinstance(final, str) else ""
    if not text or text not in rendered:
        raise ChatTemplateError("continue_final_message is set but the final message does "
                                "not appear in the chat after applying the chat template")
    at = rendered.rindex(text)
    assert isinstance(final, str)
    if rendered[at:].strip() == text:
        return rendered[:at] + final.lstrip()
    return rendered[:at + len(text)]


def _render_error(source: str, exc: Exception) -> ChatTemplateError:
    line = _template_line(exc)
    where = f" at line {line}{_source_line(source, line)}" if line is not None else ""
    what = str(exc) if isinstance(exc, jinja2.TemplateError) \
        else f"{type(exc).__name__}: {exc}"
    return ChatTemplateError(f"chat template raised an error{where}: {what}", line=line)


def _content_text(index: int, content: Any) -> str:
    field = f"messages[{index}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text" \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise InvalidRequestError(f"{field}[{j}]", 'only text parts ({"type": "text", '
                                          f'"text": "..."}}) are supported, not {part!r}')
        return "\n".join(texts)
    raise InvalidRequestError(field, "must be a string, a list of text parts or null, not "
                              f"{type(content).__name__}")


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check ``messages`` and return them as the template sees them (content as one string;
    other keys such as ``name`` or ``tool_calls`` kept).

    Raises:
        InvalidRequestError: ``messages`` is not a non-empty list of objects, or a message's
            ``role`` or ``content`` is malformed (the field is named, e.g.
            ``messages[2].role``).
    """
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages", "must be a list of message objects, not "
                                  f"{type(messages).__name__}")
    if not messages:
        raise InvalidRequestError("messages", "must hold at least one message")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with role and "
                                      f"content, not {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            what = "is missing" if role is None else f"must be one of {', '.join(ROLES)}, not " \
                f"{role!r}"
            raise InvalidRequestError(f"messages[{i}].role", what)
        found = {**message, "content": _content_text(i, message.get("content"))}
        if role == "assistant" and isinstance(message.get("tool_calls"), list):
            found["tool_calls"] = _tool_calls(i, message["tool_calls"])
        result.append(found)
    return result


def _tool_calls(index: int, calls: list[Any]) -> list[Any]:
    """An assistant message's ``tool_calls`` with each ``function.arguments`` JSON text read
    into its object, as vLLM (and transformers' tool-use templates) want them; empty or
    missing arguments are ``{}``.

    Raises:
        InvalidRequestError: arguments that are not JSON (names
            ``messages[i].tool_calls[j].function.arguments``).
    """
    found = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            found.append(call)
            continue
        arguments = function.get("arguments")
        if not arguments:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise InvalidRequestError(
                    f"messages[{index}].tool_calls[{j}].function.arguments",
                    "must be a JSON text (the arguments object)") from None
        found.append({**call, "function": {**function, "arguments": arguments}})
    return found
