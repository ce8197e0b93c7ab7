"""The chat templates' sandbox, with a budget: what one rendering may cost.

A Python thread cannot be killed, so a template that loops for ever (``{% for i in
range(100000) %}`` nested three deep) or builds a huge value (``"x" * 10**10``, ``s ~ s`` in a
loop, ``2 ** 10**9``) must be stopped from inside. The environment here is jinja2's
``ImmutableSandboxedEnvironment`` (as transformers uses it) plus checks where the rendering
spends its time or memory:

* every ``for`` loop's iterable is wrapped (the code generator's ``visit_For``), and every
  call, attribute, item and intercepted operator checks the deadline, so a runaway loop stops
  within one iteration of it;
* ``*``, ``**`` and ``+``, ``~`` (concatenation), the ``replace``/``center``/``indent``
  filters, ``lipsum`` and str methods that pad (``ljust``, ``center``, ...) refuse a result
  larger than the rendering's character bound before building it; ints are held to
  :data:`MAX_INT_BITS`; a format string with a width of 7 digits or more is refused;
* the output is gathered chunk by chunk (``Template.generate``), each chunk checking the
  output bound and the deadline;
* every millisecond of rendering (:data:`YIELD_INTERVAL`) the check hands the GIL over
  (a 0.1 ms sleep), so the event loop, waiting for it, runs at least that often.

The checks are off (a template renders exactly as in jinja2) outside :func:`budget`.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Final, Literal

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import do_center, do_indent, do_replace
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum, pass_eval_context

from ..errors import ChatTemplateError

__all__ = ["MAX_INT_BITS", "YIELD_INTERVAL", "YIELD_PAUSE", "BudgetedEnvironment",
           "RenderLimitError", "budget", "check_size"]

#: The largest int (in bits) an operator may make while a budget is on.
MAX_INT_BITS: Final = 1 << 16
#: Seconds of rendering between two hand-overs of the GIL, and how long each pauses: a
#: real pause (not ``sleep(0)``, whose thread may take the GIL straight back) lets the
#: event loop, waiting for the GIL, run (the rendering is 10 % slower past 1 ms).
YIELD_INTERVAL: Final = 0.001
YIELD_PAUSE: Final = 0.0001
_PADDING_METHODS: Final = frozenset({"ljust", "rjust", "center", "zfill"})
_WIDE_FORMAT: Final = re.compile(r"\d{7,}")


class RenderLimitError(ChatTemplateError):
    """A rendering went past its budget, and was stopped: ``kind`` is ``"time"`` (its
    seconds), ``"output"`` (its output is longer than its character bound) or ``"value"`` (it
    built a value larger than that, or an int beyond :data:`MAX_INT_BITS`)."""

    def __init__(self, message: str, *, kind: Literal["time", "output", "value"]) -> None:
        super().__init__(message)
        self.kind = kind


class _Budget:
    __slots__ = ("deadline", "max_chars", "max_value", "next_yield", "seconds")

    def __init__(self, seconds: float, max_chars: int, max_value: int) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.next_yield = time.monotonic() + YIELD_INTERVAL
        self.max_chars = max_chars
        self.max_value = max_value


_local = threading.local()


def _current() -> _Budget | None:
    found: _Budget | None = getattr(_local, "budget", None)
    return found


@contextmanager
def budget(seconds: float, max_chars: int, max_value: int) -> Iterator[Callable[[int], None]]:
    """Render under a budget in this thread: ``seconds`` from now, an output of at most
    ``max_chars`` characters, values (strings, lists) of at most ``max_value``. Yields the
    output check (give it the output's size so far; it raises :class:`RenderLimitError`)."""
    previous = _current()
    state = _Budget(seconds, max_chars, max_value)
    _local.budget = state

    def check_output(size: int) -> None:
        if size > state.max_chars:
            raise RenderLimitError(f"the rendered chat template is longer than "
                                   f"{state.max_chars} characters", kind="output")
        _check_deadline(state)

    try:
        yield check_output
    finally:
        _local.budget = previous


def _check_deadline(state: _Budget | None) -> None:
    if state is None:
        return
    now = time.monotonic()
    if now > state.deadline:
        raise RenderLimitError(f"the chat template took longer than its budget of "
                               f"{state.seconds:g} s to render", kind="time")
    if now > state.next_yield:
        # Hand the GIL over now and then: the event loop waits for it at most about this
        # long, instead of Python's 5 ms switch interval (times the threads rendering).
        time.sleep(YIELD_PAUSE)
        state.next_yield = time.monotonic() + YIELD_INTERVAL


def check_size(size: int, what: str = "a value") -> None:
    """Raise :class:`RenderLimitError` if ``size`` characters (or items) is beyond the
    current budget's bound (nothing outside a budget)."""
    state = _current()
    if state is not None and size > state.max_value:
        raise RenderLimitError(f"the chat template built {what} of {size} characters or "
                               f"items, more than the {state.max_value} allowed",
                               kind="value")


def _check_format(text: object) -> None:
    if isinstance(text, str) and _WIDE_FORMAT.search(text) and _current() is not None:
        raise RenderLimitError("the chat template used a format width of 7 digits or more",
                               kind="value")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        bits = left.bit_length()
        if operator == "**":
            bits = bits * right if right > 0 and bits > 1 else 0
        elif operator == "*":
            bits += right.bit_length()
        if bits > MAX_INT_BITS:
            raise RenderLimitError(f"the chat template built an int of more than "
                                   f"{MAX_INT_BITS} bits", kind="value")
        return
    if operator == "*":
        sized, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(count, int) and hasattr(sized, "__len__"):
            check_size(len(sized) * max(count, 0))
    elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
        check_size(len(left) + len(right))
    elif operator == "%":
        _check_format(left)


class _CodeGenerator(CodeGenerator):
    """jinja2's code generator, with every ``for`` loop's iterable and every ``~``
    concatenation going through the environment's checks."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        wrapped = copy.copy(node)
        wrapped.iter = nodes.Call(nodes.EnvironmentAttribute("checked_iter"), [node.iter],
                                  [], None, None, lineno=node.lineno)
        super().visit_For(wrapped, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


@pass_eval_context
def _replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: int | None = None) -> Any:
    text, old_text, new_text = str(s), str(old), str(new)
    found = text.count(old_text) if old_text else len(text) + 1
    if count is not None:
        found = min(found, max(count, 0))
    check_size(len(text) + found * (len(new_text) - len(old_text)))
    return do_replace(eval_ctx, s, old, new, count)


def _center(value: str, width: int = 80) -> str:
    if isinstance(width, int):
        check_size(width)
    return do_center(value, width)


def _indent(s: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    pad = width if isinstance(width, int) else len(width) if isinstance(width, str) else 0
    check_size(len(str(s)) + pad * (str(s).count("\n") + 1))
    return do_indent(s, width, first, blank)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    if isinstance(n, int) and isinstance(max, int):
        check_size(n * max * 12, "lorem ipsum")
    return str(generate_lorem_ipsum(n, html, min, max))


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the checks of this module (see the module docstring)."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters["replace"] = _replace
        self.filters["center"] = _center
        self.filters["indent"] = _indent
        self.globals["lipsum"] = _lipsum

    def call(__self, __context: Context, __obj: Any, *args: Any,
             **kwargs: Any) -> Any:
        state = _current()
        if state is not None:
            _check_deadline(state)
            owner = getattr(__obj, "__self__", None)
            name = getattr(__obj, "__name__", "")
            if isinstance(owner, str):
                if name in _PADDING_METHODS and args and isinstance(args[0], int):
                    check_size(args[0])
                elif name == "expandtabs":
                    size = args[0] if args and isinstance(args[0], int) else 8
                    check_size(len(owner) + owner.count("\t") * size)
                elif name == "replace" and len(args) >= 2:
                    old, new = str(args[0]), str(args[1])
                    found = owner.count(old) if old else len(owner) + 1
                    check_size(len(owner) + found * (len(new) - len(old)))
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        state = _current()
        if state is not None:
            _check_deadline(state)
            if attribute in ("format", "format_map"):
                _check_format(obj)  # str.format's wrapper hides which string it formats
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        state = _current()
        if state is not None:
            _check_deadline(state)
            if argument in ("format", "format_map"):
                _check_format(obj)
        return super().getitem(obj, argument)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        state = _current()
        if state is not None:
            _check_deadline(state)
            _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def checked_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``iterable``, checking the deadline before each item."""
        state = _current()
        if state is None:
            yield from iterable
            return
        for item in iterable:
            _check_deadline(state)
            yield item

    def checked_concat(self, parts: Iterable[Any]) -> str:
        """``~``: the parts as one string, refused beyond the bound."""
        texts = [str(part) for part in parts]
        check_size(sum(map(len, texts)))
        return "".join(texts)
