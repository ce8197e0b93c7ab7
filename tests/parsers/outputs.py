"""Hypothesis strategies of model outputs in each tool-call format, with reasoning blocks,
text around, unicode and escapes, several calls, and malformed or truncated calls; and the
tokenization used to stream them (each special marker one token, other text in random
pieces). Shared by the unit tests (tests/parsers) and the differential test against vLLM
(tests/interop/test_parsers_differential.py)."""

from __future__ import annotations

import json
from typing import Any

import attrs
from hypothesis import strategies as st

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS_MARK = "[ARGS]"
#: The special tokens of every format (one token id each when streamed).
SPECIALS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>",
            CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, TOOL_CALLS, ARGS_MARK)

_ALPHABET = "abcxyz ABC019 ,.:;!?\n\t\"'\\/<>{}[]()=_-éü中文😀\u2028"
_TEXT = st.text(alphabet=_ALPHABET, max_size=12)
_PLAIN = st.text(alphabet="abcxyz ABC,.!?\néü中😀", max_size=12)
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)
_SCALARS = (st.none() | st.booleans() | st.integers(-10**6, 10**6)
            | st.floats(allow_nan=False, allow_infinity=False, width=32) | _TEXT)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=6)
ARGS = st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), _VALUES,
                       max_size=4)


@attrs.frozen
class Output:
    """One generated output: the text, and what it was made of (for the test's report)."""

    text: str
    kinds: tuple[str, ...]
    calls: tuple[tuple[str, dict[str, Any]], ...]


@st.composite
def _json(draw: st.DrawFn, value: Any) -> str:
    compact = draw(st.booleans())
    return json.dumps(value, ensure_ascii=draw(st.booleans()),
                      separators=(",", ":") if compact else None)


def _py(value: Any, json_names: bool) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value] if json_names else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_py(v, json_names) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_py(v, json_names)}" for k, v in value.items()) + "}"
    return repr(value)


@st.composite
def _call(draw: st.DrawFn, fmt: str) -> tuple[str, tuple[str, dict[str, Any]], str]:
    """(text, (name, args), kind) of one call in format ``fmt``."""
    name, args = draw(NAMES), draw(ARGS)
    kind = "call"
    if fmt == "pythonic":
        json_names = draw(st.booleans())
        body = ", ".join(f"{k}={_py(v, json_names)}" for k, v in args.items())
        return f"{name}({body})", (name, args), kind
    if fmt == "qwen3_xml":
        texts = {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}
        nl = draw(st.sampled_from(["", "\n"]))
        body = "".join(f"<parameter={k}>{nl}{v}{nl}</parameter>\n" for k, v in texts.items())
        return (f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>",
                (name, texts), kind)
    encoded = draw(_json(args))
    if fmt == "mistral":  # tokenizers before v11: [TOOL_CALLS][{"name": ..., ...}, ...]
        obj = json.dumps({"name": name}, ensure_ascii=draw(st.booleans()))[:-1]
        return f'{obj}, "arguments": {encoded}}}', (name, args), kind
    if fmt == "mistral_v11":  # v11 and later: [TOOL_CALLS]name[ARGS]{...}
        if draw(st.integers(0, 4)) == 0:
            return f"{TOOL_CALLS}{name}{encoded}", (name, args), "name{args}, no [ARGS]"
        return f"{TOOL_CALLS}{name}{ARGS_MARK}{encoded}", (name, args), kind
    if fmt in ("hermes", "llama3_json"):
        key = "arguments" if fmt == "hermes" or draw(st.booleans()) else "parameters"
        obj = json.dumps({"name": name}, ensure_ascii=draw(st.booleans()))[:-1]
        text = f'{obj}, "{key}": {encoded}}}'
        if fmt == "hermes":
            nl = draw(st.sampled_from(["", "\n"]))
            text = f"<tool_call>{nl}{text}{nl}</tool_call>"
        return text, (name, args), kind
    if draw(st.integers(0, 9)) == 0:
        encoded, kind = json.dumps(args, indent=1), "multi-line arguments"
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{encoded}\n```{CALL_END}", (name, args), kind


@st.composite
def outputs(draw: st.DrawFn, fmt: str | None, reasoning: bool) -> Output:
    """An output in tool format ``fmt`` (None: plain text), with a think block if
    ``reasoning``."""
    kinds: list[str] = []
    text = ""
    if reasoning:
        shape = draw(st.sampled_from(["open+close", "close only", "open only", "none"]))
        kinds.append(f"think {shape}")
        body = draw(_TEXT)
        text = {"open+close": f"<think>{body}</think>", "close only": f"{body}</think>",
                "open only": f"<think>{body}", "none": ""}[shape]
        if draw(st.integers(0, 9)) == 0:
            text = draw(_PLAIN) + text
            kinds.append("text before <think>")
    calls: list[tuple[str, dict[str, Any]]] = []
    if fmt is not None and draw(st.integers(0, 4)):
        pieces = [draw(_call(fmt)) for _ in range(draw(st.integers(1, 3)))]
        calls = [p[1] for p in pieces]
        kinds += [p[2] for p in pieces if p[2] != "call"]
        kinds.append(f"{len(pieces)} call(s)")
        pre = draw(_PLAIN) if draw(st.integers(0, 2)) == 0 else ""
        if pre:
            kinds.append("text before calls")
        if fmt in ("hermes", "qwen3_xml"):
            body = draw(st.sampled_from(["", "\n"])).join(p[0] for p in pieces)
        elif fmt == "llama3_json":
            body = draw(st.sampled_from(["; ", ";"])).join(p[0] for p in pieces)
            if draw(st.booleans()):
                body = "<|python_tag|>" + body
        elif fmt == "pythonic":
            body = "[" + ", ".join(p[0] for p in pieces) + "]"
        elif fmt == "mistral":
            body = "[" + draw(st.sampled_from([", ", ","])).join(p[0] for p in pieces) + "]"
            if len(pieces) == 1 and draw(st.booleans()):
                body = pieces[0][0]  # one bare object, which vLLM also reads
                kinds.append("bare object")
            body = TOOL_CALLS + draw(st.sampled_from(["", " "])) + body
        elif fmt == "mistral_v11":
            body = "".join(p[0] for p in pieces)
        else:
            body = CALLS_BEGIN + "".join(p[0] for p in pieces) + CALLS_END
        post = draw(_PLAIN) if draw(st.integers(0, 3)) == 0 else ""
        if post:
            kinds.append("text after calls")
        text += pre + body + post
    else:
        text += draw(_TEXT)
    if draw(st.integers(0, 6)) == 0 and text:
        cut = draw(st.integers(0, len(text) - 1))
        if cut < len(text):
            text = text[:cut]
            kinds.append("truncated")
    return Output(text, tuple(kinds), tuple(calls))


def split_tokens(text: str, cuts: list[int]) -> list[str]:
    """``text`` as tokens: each special marker one token, the text between cut into pieces
    of the lengths in ``cuts`` (cycled, each at least 1)."""
    tokens: list[str] = []
    i = k = 0
    plain = ""

    def flush() -> None:
        nonlocal plain, k
        while plain:
            size = max(1, cuts[k % len(cuts)]) if cuts else 1
            tokens.append(plain[:size])
            plain = plain[size:]
            k += 1

    while i < len(text):
        special = next((s for s in SPECIALS if text.startswith(s, i)), None)
        if special:
            flush()
            tokens.append(special)
            i += len(special)
        else:
            plain += text[i]
            i += 1
    flush()
    return tokens


CUTS = st.lists(st.integers(1, 6), min_size=1, max_size=8)
