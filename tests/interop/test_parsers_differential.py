"""Differential test of the tool-call and reasoning parsers against vLLM 0.32's own.

Hypothesis generates model outputs in each format (tests/parsers/outputs.py: calls with
random names and JSON arguments, unicode and escapes inside, text around them, several
calls, think blocks, malformed and truncated calls), tokenized with each special marker one
token and the text between in random pieces. Each output goes, whole and token by token,
through vLLM's composed parser (``ParserManager.get_parser(...)``'s ``parse`` and
``parse_delta``, as its chat completion server drives them, over a stand-in tokenizer whose
vocabulary has the markers) and through ours (:class:`anyio_genout.parsers.OutputParser`).

Compared: reasoning, content and the calls (names; arguments as JSON values, and as text
for whole outputs), whole and streamed (the stream's accumulated result; the ids only for
being there, once per call); with a reasoning parser, the usage's reasoning token count
(vLLM's ``count_reasoning_tokens``; ours fed token by token). Every difference must be
one of the named corners, where vLLM is wrong (docs/server.md, "Tool calls and
reasoning"); the counts are printed. Needs vLLM importable (the interop venv's python:
``python -m pytest tests/interop/test_parsers_differential.py -s``, or ``nox -s interop``).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import warnings
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from anyio_genout.parsers import OutputParser, reasoning_parser_class, tool_parser
from tests.parsers.outputs import (
    ARGS_MARK,
    CUTS,
    SPECIALS,
    TOOL_CALLS,
    Output,
    outputs,
    split_tokens,
)
from tests.protocol._hyp import SCALE

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

CASES = max(1, int(400 * SCALE))
#: (tool parser, reasoning parser) pairs, as ``vllm serve`` takes them; ``mistral`` is run
#: twice, with a tokenizer before v11 (no ``[ARGS]``: the JSON form) and with a later one
#: (``mistral_v11``: vLLM reads the ``name[ARGS]{...}`` form).
COMBOS = [("hermes", None), ("hermes", "qwen3"), ("hermes", "deepseek_r1"),
          ("llama3_json", None), ("mistral", None), ("mistral_v11", None),
          ("pythonic", None), ("qwen3_xml", None),
          ("qwen3_xml", "qwen3"), ("deepseek_v3", None),
          ("deepseek_v3", "deepseek_r1"), (None, "qwen3"), (None, "deepseek_r1")]


class StandInTokenizer:
    """What vLLM's parsers ask of a tokenizer: a vocabulary with the markers, and a
    decode of the ids this test hands out (one per distinct token text)."""

    def __init__(self, without: tuple[str, ...] = ()) -> None:
        self.ids: dict[str, int] = {s: i + 1 for i, s in enumerate(SPECIALS)}
        self.texts = {i: s for s, i in self.ids.items()}
        self.specials = [s for s in SPECIALS if s not in without]

    def id(self, text: str) -> int:
        if text not in self.ids:
            self.ids[text] = len(self.ids) + 100
            self.texts[self.ids[text]] = text
        return self.ids[text]

    def get_vocab(self) -> dict[str, int]:
        return {s: self.ids[s] for s in self.specials}

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.ids.get(token) if token in self.specials else None

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.texts[i] for i in ids]

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(self.texts[i] for i in ids)

    def __len__(self) -> int:
        return 1000


TOKENIZER = StandInTokenizer()
#: A Mistral tokenizer before v11 (Mistral 7B v0.3's): ``[TOOL_CALLS]`` but no ``[ARGS]``.
PRE_V11 = StandInTokenizer(without=(ARGS_MARK,))


def _name(fmt: str | None) -> str | None:
    """The ``--tool-call-parser`` name of a generated format."""
    return "mistral" if fmt == "mistral_v11" else fmt
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

Calls = list[tuple[str | None, Any]]
Result = tuple[str | None, str | None, Calls]


def _args(text: str) -> Any:
    try:
        return ("json", json.loads(text))
    except ValueError:
        return ("text", text)


def _vllm(tools: str | None, reasoning: str | None,
          tokens: list[str]) -> tuple[Result, Result, bool]:
    cls = ParserManager.get_parser(tool_parser_name=_name(tools),
                                   reasoning_parser_name=reasoning, enable_auto_tools=True)
    assert cls is not None
    tokenizer = PRE_V11 if tools == "mistral" else TOKENIZER
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    tools=TOOLS, tool_choice="auto")
    text = "".join(tokens)
    r, c, calls = cls(tokenizer, None).parse(text, request, enable_auto_tools=True)
    whole = (r, c, [(t.name, ("text", t.arguments)) for t in calls or []])
    parser = cls(tokenizer, None)
    deltas = [parser.parse_delta(t, [tokenizer.id(t)], request, prompt_token_ids=[200],
                                 finished=i == len(tokens) - 1) for i, t in enumerate(tokens)]
    reasoning_text, content, streamed = "", "", {}
    ids_ok = True
    for d in deltas:
        if d is None:
            continue
        reasoning_text += d.reasoning or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            call = streamed.setdefault(tc.index, [None, "", 0])
            call[2] += tc.id is not None
            if tc.function is not None:
                call[0] = tc.function.name or call[0]
                call[1] += tc.function.arguments or ""
    ids_ok = all(c[2] == 1 for c in streamed.values())
    stream = (reasoning_text or None, content or None,
              [(c[0], _args(c[1])) for _, c in sorted(streamed.items())])
    return whole, stream, ids_ok


def _ours(tools: str | None, reasoning: str | None,
          tokens: list[str]) -> tuple[Result, Result, bool]:
    parser = OutputParser(
        tools=None if tools is None else tool_parser(_name(tools) or ""),
        reasoning=None if reasoning is None else reasoning_parser_class(reasoning)())
    out = parser.extract("".join(tokens))
    whole = (out.reasoning, out.content, [(c.name, ("text", c.arguments)) for c in out.tool_calls])
    stream = parser.stream()
    deltas = [stream.push(t, [TOKENIZER.id(t)]) for t in tokens] + [stream.finish()]
    reasoning_text, content, streamed = "", "", {}
    for d in deltas:
        if d is None:
            continue
        reasoning_text += d.reasoning or ""
        content += d.content or ""
        for tc in d.tool_calls:
            call = streamed.setdefault(tc.index, [None, "", 0])
            call[2] += tc.id is not None
            call[0] = tc.name or call[0]
            call[1] += tc.arguments or ""
    ids_ok = all(c[2] == 1 for c in streamed.values())
    return whole, (reasoning_text or None, content or None,
                   [(c[0], _args(c[1])) for _, c in sorted(streamed.items())]), ids_ok


def _semantic(result: Result) -> Result:
    r, c, calls = result
    return r, c, [(n, _args(a[1]) if a[0] == "text" else a) for n, a in calls]


W2 = "W2 text before <think>: vLLM's deepseek_r1 whole reading drops it, its stream keeps it"


def _whole_corners(out: Output, theirs: Result, ours: Result) -> list[str]:
    corners = []
    if theirs[0] == "" and ours[0] is None:
        corners.append("W1 empty reasoning: vLLM's deepseek_r1 says '' (its stream: none)")
    if "text before <think>" in out.kinds:
        corners.append(W2)
    if "multi-line arguments" in out.kinds:
        corners.append("W3 arguments over several lines: vLLM's deepseek_v3 loses the call")
    if TOOL_CALLS in out.text and not theirs[2] and not ours[2] and ours[1] == out.text:
        corners.append("W4 no call after [TOOL_CALLS] (mistral): vLLM's whole reading keeps "
                       "only the text after the marker, or none")
    return corners


def _stream_corners(out: Output, theirs: Result, ours: Result, whole: Result) -> list[str]:
    corners = []
    if "truncated" in out.kinds:
        corners.append("S1 output cut short: vLLM's stream loses the tail it held back "
                       "or could not read; ours sends what its whole reading finds")
    if "text before calls" in out.kinds and theirs[2] == [] and ours[2]:
        corners.append("S2 text before the JSON (llama3_json): vLLM's stream never finds the "
                       "calls its whole reading finds")
    if "text after calls" in out.kinds and theirs[1] != whole[1]:
        corners.append("S3 text after the calls: vLLM's stream does not do with it what its "
                       "whole reading does (sends it, or loses the calls)")
    if any(t[1] == ("text", "") and o[1] == ("json", {})
           for t, o in zip(theirs[2], ours[2], strict=False)):
        corners.append("S4 empty arguments {} (llama3_json): vLLM's stream sends none")
    names = [c[0] for c in theirs[2]]
    if names and names == [c[0] for c in ours[2]][:len(names)] and any(
            t[1] != o[1] and t[1][0] == "text" and o[1][0] == "json"
            for t, o in zip(theirs[2], ours[2], strict=False)):
        corners.append("S5 vLLM's stream leaves arguments unfinished (not JSON) that its "
                       "whole reading has")
    mine, extra = ours[1] or "", theirs[1] or ""
    if "</tool_call>\n" in out.text and theirs[1] != whole[1] and extra.startswith(mine) \
            and not extra[len(mine):].strip("\n"):  # theirs: ours, then the new lines
        corners.append("S7 new lines between the calls (qwen3_xml): vLLM's stream sends them "
                       "as content, its whole reading drops them")
    if theirs[1] is None and ours[1] is not None and not ours[1].strip():
        corners.append("S8 only white space before the calls (qwen3_xml): vLLM's stream "
                       "sends none of it")
    if not theirs[2] and not ours[2] and ours[1] == whole[1] != theirs[1]:
        corners.append("S9 text that begins like a call but is none ('[' pythonic, '{' "
                       "llama3_json): vLLM's stream loses it, its whole reading has it")
    if ";{" in out.text and len(theirs[2]) < len(ours[2]):
        corners.append("S6 calls joined by ';' with no space (llama3_json): vLLM's stream "
                       "skips two characters and loses the next call")
    if "multi-line arguments" in out.kinds:
        corners.append("W3 arguments over several lines: vLLM's deepseek_v3 loses the call")
    if "text before <think>" in out.kinds:
        corners.append(W2)
    if theirs[2] != ours[2] and _close(theirs[2], ours[2]) and _close(ours[2], whole[2]):
        corners.append("S10 a float with 17 significant digits (pythonic): vLLM's stream "
                       "rounds it to 16; its whole reading and ours keep the text's value")
    elif not corners and theirs[2] != ours[2] and _semantic(whole)[2] == ours[2] \
            and [c[0] for c in theirs[2]] == [c[0] for c in ours[2]] \
            and all(c[1][0] == "json" for c in theirs[2]):  # read, but another value
        corners.append("S11 vLLM's stream reads another value than its whole reading of "
                       "the same calls (pythonic: 1.1e+16 as 1.0e+16); ours: its whole "
                       "reading's")
    return corners


def _close(a: object, b: object) -> bool:
    """Equal but for floats within a relative 1e-12 (a digit lost in a float's repr)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.timeout(900)  # vLLM's engine-based parsers: about 0.2 s a case on 2 cores
@pytest.mark.parametrize(("tools", "reasoning"), COMBOS,
                         ids=[f"{t}+{r}" for t, r in COMBOS])
def test_parsers_equal_vllm_except_in_its_wrong_corners(
        tools: str | None, reasoning: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger("vllm").setLevel(logging.CRITICAL)  # its parsers log every bad call
    counts: collections.Counter[str] = collections.Counter()

    @settings(max_examples=CASES, derandomize=SCALE == 1, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(out=outputs(tools, reasoning is not None), cuts=CUTS)
    def differential(out: Output, cuts: list[int]) -> None:
        tokens = split_tokens(out.text, cuts)
        their_whole, their_stream, _ = _vllm(tools, reasoning, tokens)
        our_whole, our_stream, our_ids = _ours(tools, reasoning, tokens)
        counts["cases"] += 1
        counts["with calls"] += bool(our_whole[2])
        assert our_ids, "each streamed call has one id"
        if their_whole == our_whole:
            counts["whole: equal"] += 1
        else:
            corners = _whole_corners(out, their_whole, our_whole)
            assert corners, f"whole differs\n{out}\nvLLM {their_whole}\nours {our_whole}"
            counts.update(f"whole: {c}" for c in corners)
        if their_stream == our_stream:
            counts["streamed: equal"] += 1
        else:
            corners = _stream_corners(out, their_stream, our_stream, their_whole)
            assert corners, f"stream differs\n{out}\nvLLM {their_stream}\nours {our_stream}"
            counts.update(f"streamed: {c}" for c in corners)
        if not {"truncated", "text after calls"} & set(out.kinds):
            assert _semantic(our_whole)[2] == our_stream[2], "our stream's calls == our whole's"
        if reasoning is not None:  # the usage's reasoning tokens: vLLM's count, fed as streamed
            ids = [TOKENIZER.id(t) for t in tokens]
            theirs = ParserManager.get_parser(
                tool_parser_name=_name(tools), reasoning_parser_name=reasoning,
                enable_auto_tools=True)(TOKENIZER, None).count_reasoning_tokens(ids)
            counter = reasoning_parser_class(reasoning)().token_counter(
                TOKENIZER.convert_tokens_to_ids)
            assert counter is not None
            for token in ids:
                counter.feed([token])
            assert counter.count == theirs, f"reasoning tokens\n{out}\nvLLM {theirs}"
            counts["reasoning tokens: equal"] += 1

    differential()
    with capsys.disabled():
        print(f"\nparsers differential {tools}+{reasoning}:")
        for key, value in sorted(counts.items()):
            print(f"  {value:5d}  {key}")
    assert counts["cases"] >= min(CASES, 300)
