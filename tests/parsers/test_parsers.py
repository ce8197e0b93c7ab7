"""The tool-call and reasoning parsers: pinned examples of each format (as vLLM 0.32 reads
them), and round trips: for random outputs split at random, the streamed deltas add up to
what the whole reading gives (names, arguments as JSON, content, reasoning), every call
gets one id, and nothing a delta sent is ever taken back."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from anyio_genout.errors import InvalidRequestError
from anyio_genout.parsers import (
    DeltaMessage,
    OutputParser,
    ParsedOutput,
    ToolCall,
    reasoning_parser_class,
    tool_choice_json_schema,
    tool_parser,
    tool_parser_names,
)
from tests.parsers.outputs import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    CUTS,
    SEP,
    Output,
    outputs,
    split_tokens,
)
from tests.protocol._hyp import SCALE


def _calls(parsed: ParsedOutput) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def _run(parser: OutputParser, pieces: list[str]) -> tuple[list[DeltaMessage], ParsedOutput]:
    stream = parser.stream()
    deltas = [d for d in [stream.push(p) for p in pieces] + [stream.finish()] if d]
    reasoning = "".join(d.reasoning or "" for d in deltas) or None
    content = "".join(d.content or "" for d in deltas) or None
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for piece in d.tool_calls:
            if piece.id is not None:
                assert piece.index not in calls and piece.name is not None
                assert piece.type == "function"
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments or ""
    return deltas, ParsedOutput(reasoning, content,
                                tuple(ToolCall(n, a) for _, (n, a) in sorted(calls.items())))


HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
          '"note": "a \\"quoted\\" </b>"}}\n</tool_call>\n<tool_call>{"name": "now", '
          '"arguments": {}}</tool_call>')


def test_hermes_whole_and_streamed() -> None:
    parser = OutputParser(tools=tool_parser("hermes"))
    whole = parser.extract(HERMES)
    assert whole.content == "Let me check."
    assert _calls(whole) == [("get_weather", {"city": "Zürich", "note": 'a "quoted" </b>'}),
                             ("now", {})]
    assert whole.tool_calls[0].arguments == '{"city": "Zürich", "note": "a \\"quoted\\" </b>"}'
    deltas, streamed = _run(parser, list(HERMES))
    assert streamed.content == "Let me check." and _calls(streamed) == _calls(whole)
    assert deltas[0].content == "L"  # content streams at once, a partial tag is held back
    assert parser.extract("<tool_call>{not json}</tool_call>") == ParsedOutput(
        None, "<tool_call>{not json}</tool_call>")  # one bad call: all of it is content


def test_hermes_holds_back_a_partial_tag_then_lets_it_go() -> None:
    stream = tool_parser("hermes").stream()
    assert stream.push("a <tool") == DeltaMessage(content="a ")
    assert stream.push("box") == DeltaMessage(content="<toolbox")
    assert stream.push(" <") is not None and stream.finish() == DeltaMessage(content="<")


def test_llama3_json_pythonic_deepseek_v3() -> None:
    llama = OutputParser(tools=tool_parser("llama3_json"))
    text = ('<|python_tag|>{"name": "f", "parameters": {"x": [1, 2]}}; '
            '{"name": "g", "arguments": {}}')
    assert _calls(llama.extract(text)) == [("f", {"x": [1, 2]}), ("g", {})]
    assert llama.extract(text).content is None
    assert llama.extract("use {braces} freely").content == "use {braces} freely"
    py = OutputParser(tools=tool_parser("pythonic"))
    text = "[get_weather(city='Paris', days=-3, opts={'a': (1, 2)}), now(utc=true)]"
    assert _calls(py.extract(text)) == [("get_weather", {"city": "Paris", "days": -3,
                                                         "opts": {"a": [1, 2]}}),
                                        ("now", {"utc": True})]
    assert py.extract("[1, 2] is a list").content == "[1, 2] is a list"
    assert py.extract("[f(x=os.system('ls'))]").tool_calls == ()  # literals only
    ds = OutputParser(tools=tool_parser("deepseek_v3"))
    text = (f"Sure{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{\n  \"a\": 1\n}}\n```"
            f"{CALL_END}{CALLS_END}")
    whole = ds.extract(text)
    assert whole.content == "Sure" and _calls(whole) == [("f", {"a": 1})]  # over two lines
    _, streamed = _run(ds, split_tokens(text, [3]))
    assert streamed == ParsedOutput(None, "Sure", streamed.tool_calls)
    assert _calls(streamed) == _calls(whole)



MISTRAL_JSON = ('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", '
                '"days": [1, 2]}}, {"name": "now", "arguments": {}}]')
MISTRAL_V11 = ('Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": [1, 2]}'
               '[TOOL_CALLS]now[ARGS]{}')


def _mistral_id(call_id: str | None) -> bool:
    return call_id is not None and len(call_id) == 9 and call_id.isascii() \
        and call_id.isalnum()


@pytest.mark.parametrize("text", [MISTRAL_JSON, MISTRAL_V11], ids=["json", "v11"])
def test_mistral_both_forms_whole_and_streamed(text: str) -> None:
    parser = OutputParser(tools=tool_parser("mistral"))
    whole = parser.extract(text)
    assert whole.content == "Checking."  # the named form strips it, as vLLM
    assert _calls(whole) == [("get_weather", {"city": "Zürich", "days": [1, 2]}), ("now", {})]
    assert all(_mistral_id(c.id) for c in whole.tool_calls)  # Mistral's templates want these
    assert len({c.id for c in whole.tool_calls}) == 2
    for cuts in ([1], [3], [7]):
        deltas, streamed = _run(parser, split_tokens(text, cuts))
        assert _calls(streamed) == _calls(whole)
        assert (streamed.content or "").strip() == "Checking."
        ids = [p.id for d in deltas for p in d.tool_calls if p.id is not None]
        assert len(ids) == 2 and all(_mistral_id(i) for i in ids)
        assert not any("[TOOL_CALLS]" in (d.content or "") for d in deltas)


def test_mistral_corners() -> None:
    parser = OutputParser(tools=tool_parser("mistral"))
    bare = parser.extract('[TOOL_CALLS] {"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert _calls(bare) == [("f", {"a": 1})] and bare.content is None  # one bare object
    assert _calls(parser.extract('[TOOL_CALLS]f{"a": 1}')) == [("f", {"a": 1})]  # no [ARGS]
    none = "[TOOL_CALLS][oops, not JSON]"
    assert parser.extract(none) == ParsedOutput(None, none)  # W4: all of it is content
    named = parser.extract("[TOOL_CALLS] sorry")  # the named form: a call with no arguments
    assert _calls(named) == [("sorry", {})]
    assert parser.extract("plain text").content == "plain text"
    stream = tool_parser("mistral").stream()
    assert stream.push("a [TOOL_") == DeltaMessage(content="a ")  # a partial marker waits

def test_qwen3_xml() -> None:
    parser = OutputParser(tools=tool_parser("qwen3_coder"))
    text = ("I'll look. <tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    whole = parser.extract(text)
    assert whole.content == "I'll look."
    assert _calls(whole) == [("get_weather", {"city": "São Paulo", "days": "3"})]
    deltas, streamed = _run(parser, split_tokens(text, [2]))
    assert _calls(streamed) == _calls(whole) and streamed.content == "I'll look. "
    args = [p.arguments for d in deltas for p in d.tool_calls if p.arguments]
    assert args[0] == "{" and len(args) > 5  # the object grows value by value
    cut = parser.extract(text[:text.index("<parameter=days>") + 18])  # cut short
    assert _calls(cut) == [("get_weather", {"city": "São Paulo"})]


def test_reasoning_parsers() -> None:
    r1 = reasoning_parser_class("deepseek_r1")()
    assert r1.extract("plan</think>answer") == ("plan", "answer")  # <think> in the prompt
    assert r1.extract("<think>plan") == ("plan", None)
    assert r1.extract("hi", reasoning_ended=True) == (None, "hi")
    assert r1.prompt_ends_reasoning("<think>\n\n</think>\n\n")
    qwen = reasoning_parser_class("qwen3")
    assert qwen().extract("<think>a</think>b</think>c") == ("a", "bc")
    assert qwen().extract("a<tool_call>x") == ("a", "<tool_call>x")
    assert qwen(thinking=False).extract("<think>a</think>b") == (None, "<think>a</think>b")
    both = OutputParser(tools=tool_parser("hermes"), reasoning=qwen())
    text = '<think>why</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    whole = both.extract(text)
    assert (whole.reasoning, whole.content, _calls(whole)) == ("why", None, [("f", {"a": 1})])
    _, streamed = _run(both, split_tokens(text, [2, 5]))
    assert streamed.reasoning == "why" and _calls(streamed) == _calls(whole)
    assert streamed.content == "\n\n"  # sent before the call was known (as vLLM's stream)


def test_tool_choice_required_named_none() -> None:
    required = OutputParser(tools=tool_parser("hermes"), tool_choice="required")
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    assert _calls(required.extract(text)) == [("f", {"a": 1}), ("g", {})]
    assert required.extract("no").content is None
    _, streamed = _run(required, list(text))
    assert _calls(streamed) == [("f", {"a": 1}), ("g", {})]
    named = OutputParser(tools=tool_parser("hermes"), named_function="f")
    assert _calls(named.extract('{"a": 1}')) == [("f", {"a": 1})]
    none = OutputParser(tools=tool_parser("hermes"), tool_choice="none")
    assert none.extract(HERMES) == ParsedOutput(None, HERMES)


def test_json_schema_of_tool_choice() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {}}}}},
        {"type": "function", "function": {"name": "g"}}]
    schema = tool_choice_json_schema("required", tools, parallel_tool_calls=False)
    assert schema is not None
    assert schema["maxItems"] == 1 and schema["minItems"] == 1 and schema["$defs"] == {"P": {}}
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["f"], ["g"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object",
                                                                        "properties": {}}
    named = tool_choice_json_schema({"type": "function", "function": {"name": "f"}}, tools)
    assert named == tools[0]["function"]["parameters"]  # type: ignore[index]
    assert tool_choice_json_schema("auto", tools) is None
    with pytest.raises(InvalidRequestError, match="'h' is not among"):
        tool_choice_json_schema({"type": "function", "function": {"name": "h"}}, tools)


def test_unknown_names_and_a_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidRequestError, match=r"unknown tool parser 'nope'.*hermes"):
        tool_parser("nope")
    with pytest.raises(InvalidRequestError, match="unknown reasoning parser"):
        reasoning_parser_class("nope")
    (tmp_path / "my_plugin.py").write_text(textwrap.dedent("""
        from anyio_genout.parsers.hermes import HermesToolParser
        class Angle(HermesToolParser):
            name = "angle"
            start = "<call>"
            end = "</call>"
        class NotAParser:
            pass
    """))
    dist = tmp_path / "my_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[anyio_genout.tool_parsers]\nangle = my_plugin:Angle\nbad = my_plugin:NotAParser\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_plugin", raising=False)
    assert "angle" in tool_parser_names()
    found = tool_parser("angle").extract('<call>{"name": "f", "arguments": {}}</call>')
    assert [c.name for c in found.calls] == ["f"]
    with pytest.raises(InvalidRequestError, match="not a ToolParser subclass"):
        tool_parser("bad")


_FORMATS = [("hermes", None), ("hermes", "qwen3"), ("llama3_json", None), ("pythonic", None),
            ("mistral", None), ("mistral_v11", None), ("qwen3_xml", "qwen3"),
            ("deepseek_v3", "deepseek_r1"), (None, "qwen3"), (None, "deepseek_r1")]


@pytest.mark.parametrize(("tools", "reasoning"), _FORMATS, ids=[f"{t}+{r}" for t, r in _FORMATS])
def test_streamed_deltas_add_up_to_the_whole_reading(tools: str | None,
                                                      reasoning: str | None) -> None:
    # mistral_v11: the generated outputs' other form, read by the same parser.
    parser = OutputParser(
        tools=None if tools is None else tool_parser(tools.removesuffix("_v11")),
        reasoning=None if reasoning is None else reasoning_parser_class(reasoning)())

    @settings(max_examples=max(1, int(150 * SCALE)), derandomize=SCALE == 1, deadline=None,
              database=None, suppress_health_check=list(HealthCheck))
    @given(out=outputs(tools, reasoning is not None), cuts=CUTS)
    def round_trip(out: Output, cuts: list[int]) -> None:
        whole = parser.extract(out.text)
        _, streamed = _run(parser, split_tokens(out.text, cuts))
        assert streamed.reasoning == whole.reasoning
        if {"truncated", "text after calls", "text before calls"} & set(out.kinds):
            return  # a stream cannot take back what it sent before the end told
        assert _calls(streamed) == _calls(whole)
        if not whole.tool_calls:
            assert streamed.content == (whole.content or None)  # vLLM: "" for an empty output
        elif "text before calls" not in out.kinds:
            assert _calls(whole) == [(n, a) for n, a in out.calls]  # what the model wrote

    round_trip()
