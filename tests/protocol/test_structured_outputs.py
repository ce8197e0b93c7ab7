"""``SamplingParams.structured_outputs``: vLLM's checks before sending, its wire map, and the
engine side's strict decoding of it.

A structured-output constraint the engine cannot use must be refused locally, naming the
field; one it can use must reach the engine as vLLM's front end sends it (``_backend`` set, a
choice list sent as its grammar), and the mock engine must take it as vLLM's decoder does.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from anyio_genout import (
    Client,
    CollectedGenerateOutput,
    FinishReason,
    GenerateRequest,
    InvalidRequestError,
    ProtocolError,
    SamplingParams,
    StructuredOutputsParams,
)
from anyio_genout.protocol import AddRequest, decode_request, encode_add
from anyio_genout.protocol.structured_outputs import choice_as_grammar
from tests.cluster import generate_client

from ._hostile_requests import client_frames, hostile, observed_request
from ._hyp import fuzz_settings

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok"],
}


def nested(levels: int) -> dict[str, Any]:
    """An object with ``levels`` objects nested in each other (itself included)."""
    schema: dict[str, Any] = {}
    for _ in range(levels - 1):
        schema = {"x": schema}
    return schema


def refusal(**constraint: Any) -> InvalidRequestError:
    """The error SamplingParams.validate raises for these StructuredOutputsParams fields."""
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(InvalidRequestError) as info:
        params.validate(vocab_size=1024)
    return info.value


def sampling_wire(frames: list[bytes]) -> dict[str, Any]:
    wire: dict[str, Any] = msgpack.unpackb(frames[1], raw=False)[3]
    return wire


# ------------------------------------------------------------------ what is refused, and how


@pytest.mark.parametrize(("constraint", "field", "message"), [
    ({}, "structured_outputs", "you must use one kind of structured outputs constraint"),
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs",
     "only use one kind of structured outputs constraint but multiple are specified: json, "
     "regex"),
    ({"regex": "", "json_object": False}, "structured_outputs", "regex, json_object"),
    ({"json": "{"}, "structured_outputs.json", "is not valid JSON"),
    ({"json": "   "}, "structured_outputs.json", "cannot be an empty string"),
    ({"json": '{"maximum": NaN}'}, "structured_outputs.json", "NaN is not JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json", "must be a JSON Schema object, got a JSON "
     "array"),
    ({"json": "true"}, "structured_outputs.json", "got a JSON boolean"),
    ({"json": 5}, "structured_outputs.json", "a mapping or its JSON text), got int"),
    ({"json": {"type": "nope"}}, "structured_outputs.json", "is not a valid JSON Schema: "
     "'nope' is not valid under any of the given schemas (at $.type)"),
    ({"json": {"properties": {"a": {"minimum": "1"}}}}, "structured_outputs.json",
     "(at $.properties.a.minimum)"),
    ({"json": {"$schema": 7}}, "structured_outputs.json", "$schema must be a string"),
    ({"json": {1: {"type": "string"}}}, "structured_outputs.json",
     "object keys must be strings, got int 1"),
    ({"json": {"maximum": math.nan}}, "structured_outputs.json", "finite numbers, got nan"),
    ({"json": {"maximum": 2**64}}, "structured_outputs.json", "integers must fit in 64 bits"),
    ({"json": {"enum": {1, 2}}}, "structured_outputs.json", "only JSON values, got set"),
    ({"json": {"title": "\ud800"}}, "structured_outputs.json", "lone surrogate"),
    ({"json": nested(65)}, "structured_outputs.json",
     "nested too deeply: objects and arrays may nest at most 64 levels"),
    ({"json": json.dumps(nested(65))}, "structured_outputs.json", "at most 64 levels"),
    ({"json": "[" * 100_000}, "structured_outputs.json", "at most 64 levels"),
    ({"json": {"type": "integer", "multipleOf": 3}}, "structured_outputs.json",
     "uses multipleOf on a number at $, which vLLM's xgrammar backend does not enforce"),
    ({"json": {"properties": {"a": {"allOf": [{"type": "string"}, {"enum": ["x"]}]}}}},
     "structured_outputs.json", "allOf with more than one schema at $.properties.a"),
    ({"json": {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}},
     "structured_outputs.json", "uniqueItems on an array at $.properties.t"),
    ({"regex": "a\x00"}, "structured_outputs.regex", "must not contain a NUL character"),
    ({"regex": b"a"}, "structured_outputs.regex", "must be a string, got bytes"),
    ({"choice": []}, "structured_outputs.choice", "must not be an empty list"),
    ({"choice": ["a", 2]}, "structured_outputs.choice[1]", "must be a string, got int"),
    ({"grammar": " \n"}, "structured_outputs.grammar", "cannot be an empty string"),
    ({"json_object": False}, "structured_outputs.json_object", "must be True if set"),
    ({"json_object": 1}, "structured_outputs.json_object", "must be True if set"),
    ({"structural_tag": ""}, "structured_outputs.structural_tag", "cannot be an empty string"),
    ({"structural_tag": "{x"}, "structured_outputs.structural_tag", "is not valid JSON"),
    ({"structural_tag": "[]"}, "structured_outputs.structural_tag", "must be a JSON object"),
    ({"structural_tag": '{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'},
     "structured_outputs.structural_tag", '"structures" must be a list of objects'),
    ({"structural_tag": '{"structures": [], "triggers": "<"}'},
     "structured_outputs.structural_tag", '"triggers" must be a list of strings'),
    ({"regex": "a", "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace",
     "must be a bool"),
    ({"regex": "a", "disable_additional_properties": None},
     "structured_outputs.disable_additional_properties", "must be a bool"),
    ({"regex": "a", "whitespace_pattern": 3}, "structured_outputs.whitespace_pattern",
     "must be a string"),
])
def test_what_vllm_refuses_is_refused_naming_the_field(constraint: dict[str, Any], field: str,
                                                       message: str) -> None:
    error = refusal(**constraint)
    assert error.field == field
    assert message in error.message, error.message


def test_not_a_structured_outputs_params() -> None:
    params = SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="must be a StructuredOutputsParams") as info:
        params.validate()
    assert info.value.field == "structured_outputs"


@pytest.mark.parametrize("choice", ["ab", b"ab", {"a": 1}, 5])
def test_a_choice_that_is_no_list_is_refused_when_built(choice: Any) -> None:
    with pytest.raises(InvalidRequestError, match="must be a list of strings") as info:
        StructuredOutputsParams(choice=choice)
    assert info.value.field == "structured_outputs.choice"


@pytest.mark.parametrize("constraint", [
    {"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"json": {}}, {"json": nested(64)},
    {"json": {"$schema": "https://example.com/my-dialect", "type": "string"}},
    {"json": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "string"}},
    {"json": {"type": "string", "format": "email"}},
    {"json": '{"maximum": 1180591620717411303424}'},  # the engine parses the text, not msgpack
    {"json": {"type": "string", "pattern": "[[:alpha:]]"}},  # Python's re warns; no matter
    {"regex": ""}, {"regex": "\n"}, {"regex": "[0-9]{1,3}"},
    {"choice": ["yes", "no"]}, {"choice": [""]}, {"choice": ("é", "😀", 'quote " and \\')},
    {"grammar": 'root ::= "a" | "b"'}, {"json_object": True},
    {"structural_tag": '{"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], '
                       '"triggers": ["<a"]}'},
    {"regex": "x", "disable_any_whitespace": True, "disable_additional_properties": True,
     "whitespace_pattern": "[ ]?"},
])
def test_what_vllm_takes_is_taken_and_sent(constraint: dict[str, Any]) -> None:
    request = observed_request(params={"structured_outputs": StructuredOutputsParams(
        **constraint)})
    frames = client_frames(request)
    sent = sampling_wire(frames)["structured_outputs"]
    assert sent["_backend"] == "xgrammar" and sent["_backend_was_auto"] is True
    add = decode_request(frames)  # the mock engine takes it as vLLM's decoder does
    assert isinstance(add, AddRequest)
    assert add.sampling_wire["structured_outputs"] == sent


# ------------------------------------------------------------------ the wire map


def test_the_wire_map_is_vllms_with_every_field_in_its_order() -> None:
    params = SamplingParams(temperature=0.0, eos_token_id=2, logit_bias={5: 1.0},
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    wire = params.to_wire(max_tokens=8)
    keys = list(wire)
    # vLLM's struct order: ..., _all_stop_token_ids, structured_outputs, logit_bias, ...
    assert keys.index("structured_outputs") == keys.index("_all_stop_token_ids") + 1
    assert keys.index("logit_bias") == keys.index("structured_outputs") + 1
    assert list(wire["structured_outputs"].items()) == [
        ("json", SCHEMA), ("regex", None), ("choice", None), ("grammar", None),
        ("json_object", None), ("disable_any_whitespace", False),
        ("disable_additional_properties", False), ("whitespace_pattern", None),
        ("structural_tag", None), ("_backend", "xgrammar"), ("_backend_was_auto", True)]
    assert "structured_outputs" not in SamplingParams().to_wire()


def test_a_choice_travels_as_its_grammar_as_vllm_sends_it() -> None:
    params = StructuredOutputsParams(choice=["yes", 'say "hi"\n', "tab\tbell\x07del\x7f"])
    wire = params.to_wire()
    assert wire["choice"] is None
    assert wire["grammar"] == ('root ::= "yes" | "say \\"hi\\"\\n" | '
                               '"tab\\tbell\\u0007del\\u007f"')
    assert choice_as_grammar(["a\\b"]) == 'root ::= "a\\\\b"'


def test_a_schema_mapping_is_sent_as_plain_json_data() -> None:
    schema = {"type": "object", "enum": ({"a": 1.5},), "title": "t"}
    wire = StructuredOutputsParams(json=schema).to_wire()
    assert wire["json"] == {"type": "object", "enum": [{"a": 1.5}], "title": "t"}
    assert wire["json"] is not schema
    assert StructuredOutputsParams(json='{"type": "string"}').to_wire()["json"] == \
        '{"type": "string"}'


def test_the_engine_side_round_trip() -> None:
    original = StructuredOutputsParams(choice=["a", "b"], disable_any_whitespace=True,
                                       whitespace_pattern=" ")
    request = observed_request(params={"structured_outputs": original})
    add = decode_request(client_frames(request))
    assert isinstance(add, AddRequest)
    decoded = add.request.sampling_params.structured_outputs
    # As vLLM's engine sees it: the choice arrived as its grammar.
    assert decoded == StructuredOutputsParams(grammar=choice_as_grammar(["a", "b"]),
                                              disable_any_whitespace=True,
                                              whitespace_pattern=" ")
    assert decoded.to_wire() == add.sampling_wire["structured_outputs"]
    again = decode_request(encode_add(add.request))
    assert isinstance(again, AddRequest)
    assert again.request.sampling_params == add.request.sampling_params


# ------------------------------------------------------------------ the engine side's decoder


def _add_frames(structured: Any) -> list[bytes]:
    sampling = {"max_tokens": 4, "structured_outputs": structured}
    payload = ["r", [1, 2, 3], None, sampling, None, 0.0, None, None, None]
    return [b"\x00", msgpack.packb(payload, use_bin_type=True)]


BASE = StructuredOutputsParams(regex="a").to_wire()


@pytest.mark.parametrize("structured", [
    None, {"regex": "a+"}, {"regex": "a", "_backend": None}, {**BASE, "unknown": [1]},
    {**BASE, "regex": None, "choice": []}, {**BASE, "regex": None, "json_object": False},
    {**BASE, "regex": None, "grammar": ""}, {**BASE, "regex": None, "json": {1: 2}},
])
def test_the_mock_decodes_what_vllms_decoder_decodes(structured: Any) -> None:
    """vLLM's msgspec decoder takes these (the engine then fails only that request for an
    empty choice list or no ``_backend``); its input thread would not die."""
    assert isinstance(decode_request(_add_frames(structured)), AddRequest)


@pytest.mark.parametrize(("structured", "message"), [
    ({}, "exactly one kind of structured outputs constraint must be set, got 0: none"),
    ({**BASE, "json": "{}"}, "got 2: json, regex"),
    ([1, 2], "structured_outputs: expected a map with str keys or nil, got"),
    ({**BASE, "json": 5}, "structured_outputs.json: expected str, map or nil"),
    ({**BASE, "choice": "ab"}, "structured_outputs.choice: expected [str] or nil"),
    ({**BASE, "regex": None, "choice": ["a", 1]}, "structured_outputs.choice: expected"),
    ({**BASE, "json_object": 1}, "structured_outputs.json_object: expected bool or nil"),
    ({**BASE, "disable_any_whitespace": 1}, "disable_any_whitespace: expected bool"),
    ({**BASE, "_backend": 3}, "structured_outputs._backend: expected str or nil"),
    ({**BASE, "_backend_was_auto": None}, "_backend_was_auto: expected bool"),
    ({**BASE, "whitespace_pattern": 3}, "whitespace_pattern: expected str or nil"),
])
def test_the_mock_refuses_what_kills_vllms_input_thread(structured: Any, message: str) -> None:
    with pytest.raises(ProtocolError, match=r"EngineCoreRequest\.sampling_params") as info:
        decode_request(_add_frames(structured))
    assert message in str(info.value)


# ------------------------------------------------------------------ hostile values


_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6))
_schemaish = st.recursive(
    st.one_of(_json_leaf, st.sampled_from(["object", "string", "integer", "array"])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "minimum",
                                         "required", "pattern", "allOf", "$schema", "x"]),
                        inner, max_size=3)),
    max_leaves=8)
_values = st.one_of(hostile, _schemaish, _schemaish.map(json.dumps), st.text(max_size=8),
                    st.lists(st.text(max_size=3), max_size=3))


@fuzz_settings(400)
@given(kinds=st.lists(st.sampled_from(_KINDS + _OPTIONS), min_size=0, max_size=3, unique=True),
       data=st.data())
def test_hostile_values_are_refused_naming_the_field_or_sent_whole(kinds: list[str],
                                                                   data: st.DataObject) -> None:
    values = {kind: data.draw(_values, label=kind) for kind in kinds}
    try:
        constraint = StructuredOutputsParams(**values)
        frames = client_frames(observed_request(params={"structured_outputs": constraint}))
    except InvalidRequestError as exc:
        assert exc.field == "structured_outputs" or exc.field.split("[")[0] in {
            f"structured_outputs.{kind}" for kind in kinds}, exc
        assert str(exc).startswith(f"invalid request: {exc.field}: ")
        return
    # Taken: exactly one constraint, msgpack-encoded whole, decoded by the mock as by vLLM.
    assert sum(kind in _KINDS and values[kind] is not None for kind in kinds) == 1
    add = decode_request(frames)
    assert isinstance(add, AddRequest)
    assert add.sampling_wire["structured_outputs"] == constraint.to_wire()


# ------------------------------------------------------------------ what is remembered


def test_a_schema_text_is_checked_once_and_the_params_remember_it() -> None:
    from anyio_genout.protocol import structured_outputs as module

    text = json.dumps({**SCHEMA, "title": "checked once"})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=text))
    before = module._cached_schema_problem.cache_info()
    params.validate(vocab_size=10)
    SamplingParams(structured_outputs=StructuredOutputsParams(json=text)).validate()
    after = module._cached_schema_problem.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    object.__setattr__(params, "top_k", -5)  # behind its back: a check that ran would refuse
    params.validate(vocab_size=10)  # remembered
    object.__setattr__(params, "top_k", 0)
    assert params.wire_for_request(4) is params.wire_for_request(4)


def test_a_schema_mapping_changed_after_a_check_is_checked_again() -> None:
    schema: dict[str, Any] = {"type": "object"}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    params.validate(vocab_size=10)
    assert params.wire_for_request(4) is not params.wire_for_request(4)
    schema["type"] = "nope"  # the caller changed the schema after the first request
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.json"):
        params.validate(vocab_size=10)


# ------------------------------------------------------------------ through the mock engine


@pytest.mark.anyio
async def test_generate_sends_the_constraint_and_refuses_a_bad_one_before_sending() -> None:
    # The mock has no grammar backend: it ends each constrained request as an engine that
    # cannot prepare it does (finish reason error, no tokens); what it received is tested.
    async with generate_client(mock={"keep_history": True}) as (client, cluster):
        good = StructuredOutputsParams(choice=["yes", "no"])
        refused = await _generate(client, "so-1", good)
        assert (refused.token_ids, refused.finish_reason) == ([], FinishReason.ERROR)
        bad = StructuredOutputsParams(json={"type": "object"}, regex="a")
        with pytest.raises(InvalidRequestError) as info:
            await _generate(client, "so-2", bad)
        assert info.value.field == "structured_outputs"
        schema = StructuredOutputsParams(json=SCHEMA)
        refused = await _generate(client, "so-3", schema)
        assert (refused.token_ids, refused.finish_reason) == ([], FinishReason.ERROR)
        assert client.engine.is_healthy
        adds = [r for r in cluster.engine.received if isinstance(r, AddRequest)]
        assert [add.request.sampling_params.structured_outputs for add in adds] == [
            StructuredOutputsParams(grammar=choice_as_grammar(["yes", "no"])), schema]


async def _generate(client: Client, rid: str,
                    constraint: StructuredOutputsParams) -> CollectedGenerateOutput:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                            structured_outputs=constraint)
    request = GenerateRequest(request_id=rid, prompt_token_ids=[11, 22], sampling_params=params)
    async with client.generate(request) as stream:
        return await stream.collect_output()
