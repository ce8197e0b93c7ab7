"""Structured outputs against vLLM 0.32 itself (``nox -s interop``).

Two parts:

* the wire, without an engine: hypothesis-generated constraints go through this client's
  validation and through vLLM's own front end (``SamplingParams.verify`` with the default
  ``StructuredOutputsConfig``: backend ``auto``, and the model's tokenizer). What both take
  must be what vLLM sends, byte for byte (``MsgpackEncoder``), decoded by vLLM's engine
  decoder into the same ``StructuredOutputsParams`` (``_backend`` included); what only this
  client takes must be syntax the engine checks itself (regex, grammar, structural tag);
* a real engine with a tokenizer: the tiny random model with the project's byte-level BPE
  tokenizer (1024 tokens, as the model's vocabulary), served without
  ``--skip-tokenizer-init``. Constrained by a JSON schema its text parses and validates
  against the schema; a ``choice`` gives one of the choices; a regex output matches it; a
  regex or grammar the engine cannot compile ends that request with ``FinishReason.ERROR``.
"""

from __future__ import annotations

import collections
import json
import re
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from anyio_genout import (
    Client,
    FinishReasonKind,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
    StructuredOutputsParams,
)
from anyio_genout.vllm import VllmEngines
from tests.protocol._hostile_requests import VOCAB, client_frames, observed_request
from tests.protocol._hyp import SCALE

from .conftest import INTEROP_TIMEOUT, RealVllm, running_client, unique_id

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecation noise
    pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
    from transformers import PreTrainedTokenizerFast
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import StructuredOutputsParams as VllmStructuredOutputsParams
    from vllm.v1.engine import EngineCoreRequest as VllmEngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

pytestmark = pytest.mark.timeout(INTEROP_TIMEOUT)

BUNDLED = Path(__file__).resolve().parents[2] / "anyio_genout" / "text" / "bundled"
CASES = max(1, int(300 * SCALE))
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


# ------------------------------------------------------------------ the wire (no engine)


class _ModelConfig:
    """The parts of vLLM's ModelConfig that ``SamplingParams.verify`` reads."""

    max_logprobs = 20
    max_model_len = 512
    is_diffusion = False

    def get_vocab_size(self) -> int:
        return VOCAB


_TOKENIZER = PreTrainedTokenizerFast.from_pretrained(BUNDLED)
_DECODER = MsgpackDecoder(VllmEngineCoreRequest)


def vllm_front_end(constraint: dict[str, Any]) -> VllmStructuredOutputsParams | str:
    """What vLLM's front end makes of these fields (``_backend`` set, a choice rewritten),
    or why it refuses them."""
    try:
        so = VllmStructuredOutputsParams(**constraint)
        params = VllmSamplingParams(max_tokens=8, structured_outputs=so,
                                    output_kind=RequestOutputKind.DELTA)
        params.verify(_ModelConfig(), None, StructuredOutputsConfig(), _TOKENIZER)  # type: ignore[arg-type]
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:80]}"
    assert params.structured_outputs is not None
    return params.structured_outputs


def check_same_wire(frames: list[bytes], theirs: VllmStructuredOutputsParams) -> None:
    """Our ADD carries what vLLM's front end sends, decoded by vLLM's engine decoder."""
    ours = msgpack.unpackb(frames[1], raw=False)[3]["structured_outputs"]
    assert msgpack.packb(ours, use_bin_type=True) == MsgpackEncoder().encode(theirs)[0]
    decoded = _DECODER.decode(frames[1:]).sampling_params
    assert decoded.structured_outputs == theirs
    assert (decoded.structured_outputs._backend, decoded.structured_outputs._backend_was_auto) \
        == ("xgrammar", True)
    # The whole map, in vLLM's key order, is what vLLM's encoder writes for that request.
    again = msgpack.unpackb(MsgpackEncoder().encode(decoded)[0], object_pairs_hook=list)
    assert msgpack.unpackb(frames[1], object_pairs_hook=list)[3] == again


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(-1e3, 1e3),
                  st.text(max_size=4))
_schema = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "boolean", "null"])}),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(st.text(max_size=3), inner,
                                                             max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
        st.fixed_dictionaries({"enum": st.lists(_leaf, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=2)}),
        st.tuples(inner, st.dictionaries(st.sampled_from(
            ["minimum", "maxLength", "multipleOf", "uniqueItems", "pattern", "format",
             "required", "title", "type"]), _leaf, max_size=2)).map(
            lambda pair: {**pair[0], **pair[1]}),
    ), max_leaves=6)
_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "json": st.one_of(_schema, _schema.map(json.dumps), st.sampled_from(
        ["", "{", "[1]", "true", '{"type": "nope"}', '{"maximum": NaN}'])),
    "regex": st.one_of(st.sampled_from(
        ["", "[a-z]+", r"\d{2,4}", "(a|b)*c", "(", "[z-a]", "a{3,1}", "\x00", "é+", r"\p{L}"]),
        st.text(st.characters(codec="ascii"), max_size=6)),
    "choice": st.lists(st.text(max_size=5), max_size=4),
    "grammar": st.sampled_from(['root ::= "a" | "b"', "root ::= (", " ", 'start: "x"',
                                'root ::= [a-z]+ "!"']),
    "json_object": st.booleans(),
    "structural_tag": st.sampled_from([
        "", "{", "[]", '{"structures": [], "triggers": []}',
        '{"structures": [{"begin": "<a>", "schema": {"type": "integer"}, "end": "</a>"}], '
        '"triggers": ["<a"]}',
        '{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}',
        '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}']),
}
_OPTIONS: dict[str, st.SearchStrategy[Any]] = {
    "disable_any_whitespace": st.booleans(),
    "disable_additional_properties": st.booleans(),
    "whitespace_pattern": st.one_of(st.none(), st.sampled_from([" ", "[ \n]*"])),
}


@st.composite
def constraints(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.sampled_from([1] * 8 + [0, 2]))
    kinds = draw(st.lists(st.sampled_from(_KINDS), min_size=count, max_size=count,
                          unique=True))
    found = {kind: draw(_VALUES[kind], label=kind) for kind in kinds}
    for option, values in _OPTIONS.items():
        if draw(st.booleans()):
            found[option] = draw(values, label=option)
    return found


def _encodes(so: VllmStructuredOutputsParams) -> bool:
    try:
        MsgpackEncoder().encode(so)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("levels", [64, 65])
def test_the_nesting_limit_is_vllms(levels: int) -> None:
    schema: dict[str, Any] = {}
    for _ in range(levels - 1):
        schema = {"x": schema}
    theirs = vllm_front_end({"json": schema})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    if levels == 64:
        assert not isinstance(theirs, str), theirs
        params.validate()
    else:
        assert isinstance(theirs, str) and "nested too deeply" in theirs
        with pytest.raises(InvalidRequestError, match="nested too deeply"):
            params.validate()


def test_what_the_client_sends_is_what_vllm_sends(capsys: pytest.CaptureFixture[str]) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    stricter: collections.Counter[str] = collections.Counter()

    @settings(max_examples=CASES, derandomize=SCALE == 1, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(constraint=constraints())
    @example(constraint={"json": {"type": "integer", "multipleOf": 3}})
    @example(constraint={"json": {"allOf": [{"type": "string"}, {"enum": ["x"]}]}})
    @example(constraint={"json": {"maximum": 2**70}})
    @example(constraint={"json": '{"maximum": 1180591620717411303424}'})
    @example(constraint={"json": {"type": "string", "pattern": "[[:alpha:]]"}})
    @example(constraint={"regex": r"\p{L}+"})
    @example(constraint={"choice": ["é", 'say "hi"\n', "tab\t\x07"]})
    def differential(constraint: dict[str, Any]) -> None:
        outcomes["generated"] += 1
        theirs = vllm_front_end(constraint)
        vllm_xgrammar = not isinstance(theirs, str) and theirs._backend == "xgrammar"
        try:
            ours = StructuredOutputsParams(**constraint)
            frames = client_frames(observed_request(params={"structured_outputs": ours}))
        except InvalidRequestError as exc:
            assert exc.field.startswith("structured_outputs"), exc
            if isinstance(theirs, str):
                outcomes["refused by both"] += 1
            elif vllm_xgrammar and not _encodes(theirs):
                outcomes["refused; vLLM's own encoder fails on it"] += 1
            elif vllm_xgrammar:
                outcomes["refused; vLLM takes it for xgrammar"] += 1
                stricter[re.sub(r"\[\d+\]", "", exc.field) + ": " + exc.message[:40]] += 1
            else:
                outcomes[f"refused; vLLM hands it to {theirs._backend}"] += 1
            return
        if vllm_xgrammar:
            assert not isinstance(theirs, str)
            check_same_wire(frames, theirs)
            outcomes["taken by both, same wire"] += 1
            return
        # Only syntax the engine checks itself: a bad one fails only its request.
        kind = next(k for k in _KINDS if constraint.get(k) is not None)
        assert kind in ("regex", "grammar", "structural_tag"), (constraint, theirs)
        outcomes[f"taken; vLLM: {'refuses' if isinstance(theirs, str) else 'guidance'} "
                 f"({kind} syntax, the engine's to check)"] += 1

    differential()
    with capsys.disabled():
        print(f"\nstructured outputs differential: {outcomes.pop('generated')} cases")
        for key, count in sorted(outcomes.items()):
            print(f"  {count:5d}  {key}")
        for key, count in stricter.most_common():
            print(f"         {count:4d} x {key}")
    assert outcomes["taken by both, same wire"] >= CASES // 5


# ------------------------------------------------------------------ a real engine


@pytest.fixture(scope="module")
def text_model(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory) -> RealVllm:
    """The tiny model with the project's byte-level BPE tokenizer (JSON needs characters the
    model folder's own WordLevel ``tN`` vocabulary does not have)."""
    tokenizer = json.loads((BUNDLED / "tokenizer.json").read_text(encoding="utf-8"))
    size = len(tokenizer["model"]["vocab"]) + sum(
        t["id"] not in tokenizer["model"]["vocab"].values() for t in tokenizer["added_tokens"])
    if size != real_vllm.vocab_size:
        pytest.skip(f"the bundled tokenizer has {size} tokens, the model {real_vllm.vocab_size}")
    folder = tmp_path_factory.mktemp("tiny-bpe")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        (folder / name).symlink_to(Path(real_vllm.model, name))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(BUNDLED / name)
    return RealVllm(str(folder), real_vllm.command, real_vllm.vocab_size, 2)


@pytest.fixture(scope="module")
async def served(text_model: RealVllm) -> AsyncIterator[tuple[VllmEngines, Client]]:
    # Structured outputs need the engine's tokenizer: undo the launcher's default.
    async with running_client(text_model, extra_args=["--no-skip-tokenizer-init"]) as served:
        yield served


@pytest.fixture
def client(served: tuple[VllmEngines, Client]) -> Client:
    engines, client = served
    assert engines.running, f"the shared engine died: {engines.exit_error}"
    assert client.engine.is_healthy, client.engine.health_error
    return client


_DECODE = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
PROMPT = [1, 40, 50, 60]


async def constrained(client: Client, constraint: StructuredOutputsParams | None, *,
                      seed: int, max_tokens: int = 160) -> tuple[str, FinishReasonKind]:
    """The decoded text and the finish reason of one seeded, EOS-stopped generation."""
    params = SamplingParams(max_tokens=max_tokens, eos_token_id=2, seed=seed,
                            structured_outputs=constraint)
    request = GenerateRequest(request_id=unique_id("so"), prompt_token_ids=PROMPT,
                              sampling_params=params)
    async with client.generate(request) as stream:
        out = await stream.collect_output()
    return _DECODE.decode(list(out.token_ids), skip_special_tokens=True), out.finish_reason.kind


async def several(client: Client, constraint: StructuredOutputsParams,
                  seeds: range) -> list[tuple[str, FinishReasonKind]]:
    results: dict[int, tuple[str, FinishReasonKind]] = {}

    async def run(seed: int) -> None:
        results[seed] = await constrained(client, constraint, seed=seed)

    async with anyio.create_task_group() as tg:
        for seed in seeds:
            tg.start_soon(run, seed)
    return [results[seed] for seed in seeds]


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "color", "tags"],
    "additionalProperties": False,
}


@pytest.mark.anyio
@pytest.mark.parametrize("as_text", [False, True], ids=["mapping", "json-text"])
async def test_a_json_schema_constrains_the_text(client: Client, as_text: bool) -> None:
    constraint = StructuredOutputsParams(json=json.dumps(SCHEMA) if as_text else SCHEMA)
    plain, _ = await constrained(client, None, seed=1, max_tokens=24)
    with pytest.raises(ValueError):
        json.loads(plain)  # unconstrained, the random model writes no JSON
    for text, finish in await several(client, constraint, range(1, 5)):
        assert finish is FinishReasonKind.STOP, text  # the grammar ended it with EOS
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.anyio
async def test_a_choice_gives_one_of_the_choices(client: Client) -> None:
    choices = ["yes", "no", "maybe", "ça va 😀"]
    results = await several(client, StructuredOutputsParams(choice=choices), range(10, 16))
    assert all(finish is FinishReasonKind.STOP for _, finish in results)
    assert {text for text, _ in results} <= set(choices)


@pytest.mark.anyio
async def test_a_regex_output_matches_it(client: Client) -> None:
    pattern = r"[a-z]{3,8}-[0-9]{2}( ok)?"
    for text, finish in await several(client, StructuredOutputsParams(regex=pattern),
                                      range(20, 24)):
        assert finish is FinishReasonKind.STOP
        assert re.fullmatch(pattern, text), text


@pytest.mark.anyio
@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(regex="(unclosed"),
    StructuredOutputsParams(grammar="root ::= ("),
], ids=["regex", "grammar"])
async def test_syntax_the_engine_cannot_compile_fails_only_that_request(
        client: Client, constraint: StructuredOutputsParams) -> None:
    text, finish = await constrained(client, constraint, seed=3)
    assert (text, finish) == ("", FinishReasonKind.ERROR)
    after, finish = await constrained(client, StructuredOutputsParams(choice=["a", "b"]),
                                      seed=3)
    assert after in ("a", "b") and finish is FinishReasonKind.STOP
    assert client.engine.is_healthy
