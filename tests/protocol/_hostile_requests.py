"""Hypothesis strategies for generate requests with a few hostile fields, and the client's
request path without I/O (shared by tests/protocol/test_validation.py and the differential
test against vLLM's own decoder in tests/interop/test_validation_differential.py).

A :class:`Case` holds the keyword arguments of a :class:`GenerateRequest` and of its
:class:`SamplingParams`: every field valid (edge values included) except the zero to two
fields named in ``hostile``, which hold anything at all (wrong types, huge integers, NaN,
lone surrogates, numpy scalars, containers msgpack cannot encode...).
"""

from __future__ import annotations

import math
import types
from typing import Any, Final

import attrs
import numpy as np
from hypothesis import strategies as st

from anyio_genout import GenerateRequest, InvalidRequestError, LoRARequest, SamplingParams
from anyio_genout.generate.request import internal_request_id
from anyio_genout.protocol import encode_add

VOCAB: Final = 1024
MAX_MODEL_LEN: Final = 512
MAX_LOGPROBS: Final = 20
EOS: Final = 2

_tokens = st.integers(0, VOCAB - 1)
_text = st.text(max_size=12)  # hypothesis never draws surrogates unless asked
_surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                      max_size=2)
_BOUNDARY_INTS: Final = (
    -(2**64), -(2**63) - 1, -(2**63), -(2**31) - 1, -2, -1, 0, 1, 2, 3, 16, 17, 20, 21,
    VOCAB - 1, VOCAB, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, 16384, 16385, 2**31 - 1, 2**31,
    2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, 10**400,
)
_BOUNDARY_FLOATS: Final = (
    -math.inf, -2.0000001, -2.0, -1.0, -0.0, 0.0, 5e-324, 1e-6, 1e-5, 0.005, 0.5, 1.0,
    1.0000001, 2.0, 2.0000001, 100.0, 1e300, math.inf, math.nan,
)


class _Opaque:
    """Something no codec knows."""

    def __repr__(self) -> str:
        return "<opaque>"


def _numpy_scalars() -> st.SearchStrategy[Any]:
    return st.sampled_from([np.int64(1), np.int32(5), np.uint8(3), np.uint64(2**64 - 1),
                            np.int64(-1), np.float32(0.5), np.float64(0.5), np.bool_(True)])


def _googol_power() -> int:
    return 10**5000  # more digits than int() will print (ValueError from str/repr)


_huge = st.builds(_googol_power)
_scalars: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from(_BOUNDARY_INTS), _huge,
    st.floats(), st.sampled_from(_BOUNDARY_FLOATS), _text, _surrogates,
    st.binary(max_size=3), _numpy_scalars(), st.just(_Opaque()), st.just(1j),
)
_keys: st.SearchStrategy[Any] = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from(_BOUNDARY_INTS), _huge,
    st.floats(), _text, _surrogates, st.binary(max_size=3), st.tuples(st.integers(), _text),
    st.frozensets(st.integers(), max_size=2),
)

#: Anything at all.
hostile: st.SearchStrategy[Any] = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(_keys, inner, max_size=3),
        st.lists(inner, max_size=3).map(lambda v: np.array(v, dtype=object)),
        st.sets(st.integers(), max_size=2),
    ),
    max_leaves=6,
)


def _plain_json(depth: int = 0) -> st.SearchStrategy[Any]:
    # What extra_args may hold: what msgpack carries, tuple keys included.
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                       st.floats(), _text, st.binary(max_size=3))
    keys = st.one_of(_text, st.integers(-(2**63), 2**64 - 1), st.none(), st.booleans(),
                     st.tuples(st.integers(0, 9), st.integers(0, 9)))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner),
        st.dictionaries(keys, inner, max_size=3)), max_leaves=5)


def _prompts() -> st.SearchStrategy[Any]:
    lists = st.lists(_tokens, min_size=1, max_size=40)
    return st.one_of(
        lists, lists.map(tuple),
        st.tuples(lists, st.sampled_from(["<i8", "<i4", "<u2", "<u4", "<u8", ">i8"])).map(
            lambda v: np.array(v[0], dtype=v[1])),
        lists.map(lambda v: [np.int64(t) for t in v]),
    )



#: Valid values, edges included, for every field (valid with VOCAB, MAX_MODEL_LEN,
#: MAX_LOGPROBS, each on its own and together).
VALID_REQUEST: Final[dict[str, st.SearchStrategy[Any]]] = {
    "request_id": st.text(min_size=1, max_size=16),
    "prompt_token_ids": _prompts(),
    "arrival_time": st.one_of(st.none(), st.floats(0.0, 2e9), st.integers(0, 2**31)),
    "cache_salt": st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    "trace_headers": st.one_of(st.none(), st.dictionaries(_text, _text, max_size=3)),
    "priority": st.integers(-(2**63), 2**63 - 1),
    "data_parallel_rank": st.sampled_from([None, 0]),
    "lora_request": st.one_of(st.none(), st.builds(
        LoRARequest, _text, st.integers(1, 2**63 - 1), st.text(min_size=1, max_size=8))),
}
VALID_PARAMS: Final[dict[str, st.SearchStrategy[Any]]] = {
    "n": st.just(1),
    "presence_penalty": st.one_of(st.floats(-2.0, 2.0), st.integers(-2, 2)),
    "frequency_penalty": st.one_of(st.floats(-2.0, 2.0), st.integers(-2, 2)),
    "repetition_penalty": st.one_of(st.floats(5e-324, 1e300), st.integers(1, 10)),
    "temperature": st.one_of(st.floats(0.0, 2.0), st.sampled_from([0, 1, 2])),
    "top_p": st.one_of(st.floats(5e-324, 1.0), st.just(1)),
    "top_k": st.one_of(st.integers(-1, 2 * VOCAB), st.sampled_from([2**31, 2**63 - 1])),
    "min_p": st.one_of(st.floats(0.0, 1.0), st.sampled_from([0, 1])),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    "stop_token_ids": st.lists(_tokens, max_size=4),
    "stop_token_sequences": st.lists(st.lists(_tokens, min_size=1, max_size=3), max_size=2),
    "ignore_eos": st.booleans(),
    # Above the context: refused, as vLLM's front end does (resolve_max_tokens).
    "max_tokens": st.one_of(st.none(), st.integers(4, MAX_MODEL_LEN)),
    "min_tokens": st.integers(0, 4),
    "logprobs": st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    "eos_token_id": st.one_of(st.none(), _tokens),
    "bad_words_token_ids": st.one_of(st.none(), st.lists(
        st.lists(_tokens, min_size=1, max_size=3), max_size=3)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(
        _tokens, st.one_of(st.floats(allow_nan=False), st.integers(-100, 100)), max_size=3)),
    "allowed_token_ids": st.one_of(st.none(), st.lists(_tokens, min_size=1, max_size=5)),
    "skip_reading_prefix_cache": st.one_of(st.none(), st.booleans()),
    "extra_args": st.one_of(st.none(), st.dictionaries(_text, _plain_json(), max_size=3)),
}
#: Fields whose error may name a neighbour: ``min_tokens`` is checked against
#: ``max_tokens`` and, when that is None, against what the prompt leaves of the context.
_RELATED: Final = {"max_tokens": {"min_tokens"}, "prompt_token_ids": {"min_tokens"},
                   "stop_token_sequences": set(), "request_id": set()}


def _hostile_for(field: str) -> st.SearchStrategy[Any]:
    extra: list[st.SearchStrategy[Any]] = []
    if field == "lora_request":
        extra.append(st.builds(LoRARequest, hostile, hostile, hostile))
        extra.append(st.builds(LoRARequest, _text, st.sampled_from(_BOUNDARY_INTS)))
    if field == "prompt_token_ids":
        extra.append(st.lists(hostile, min_size=1, max_size=3))
        extra.append(st.lists(st.sampled_from(_BOUNDARY_INTS), min_size=1, max_size=3))
        extra.append(st.just(np.ones(3, dtype=np.float32)))
    return st.one_of(hostile, *extra)


@attrs.frozen
class Case:
    request: dict[str, Any]
    params: dict[str, Any]
    hostile: frozenset[str]

    def allowed_error_fields(self) -> set[str]:
        """Field roots an InvalidRequestError may name for this case."""
        allowed = set(self.hostile)
        for field in self.hostile:
            allowed |= _RELATED.get(field, set())
        return allowed


@st.composite
def cases(draw: st.DrawFn, max_hostile: int = 2) -> Case:
    names = sorted(VALID_REQUEST) + sorted(VALID_PARAMS)
    chosen = frozenset(draw(st.lists(st.sampled_from(names), max_size=max_hostile,
                                     unique=True)))
    request = {k: draw(_hostile_for(k) if k in chosen else s)
               for k, s in VALID_REQUEST.items()}
    params = {k: draw(_hostile_for(k) if k in chosen else s)
              for k, s in VALID_PARAMS.items()}
    return Case(request, params, chosen)


def field_root(field: str) -> str:
    """``"logit_bias[5]"`` -> ``"logit_bias"``; ``"lora_request.lora_path"`` ->
    ``"lora_request"``."""
    for i, ch in enumerate(field):
        if ch in "[. ":
            return field[:i]
    return field


def build(case: Case) -> GenerateRequest:
    """The user's objects (construction may raise InvalidRequestError)."""
    params = SamplingParams(**case.params)
    return GenerateRequest(sampling_params=params, **case.request)


def client_frames(request: GenerateRequest, *, vocab_size: int = VOCAB,
                  max_model_len: int = MAX_MODEL_LEN, max_logprobs: int = MAX_LOGPROBS,
                  eos_token_id: int | None = EOS, randomize: bool = True) -> list[bytes]:
    """What ``Client.generate`` and the engine client's ``_open_stream`` do before sending:
    the internal id, the engine request (EOS filled in), the one validation, ``max_tokens``
    resolved against ``max_model_len`` (the one rule), the ADD frames."""
    internal = internal_request_id(request.request_id, randomize)
    engine_request = request.to_engine_request(internal, eos_token_id=eos_token_id)
    engine_request.validate(vocab_size=vocab_size, max_model_len=max_model_len,
                            max_logprobs=max_logprobs)
    requested = engine_request.max_tokens
    if requested is None:
        requested = engine_request.sampling_params.max_tokens
    max_tokens = engine_request.resolved_max_tokens(max_model_len)
    if max_tokens != requested:
        engine_request = attrs.evolve(engine_request, max_tokens=max_tokens)
    return encode_add(engine_request)


def run_client(case: Case, **limits: Any) -> list[bytes] | InvalidRequestError:
    """The frames the client sends for ``case``, or the InvalidRequestError it raises.

    Any other exception propagates (and fails the calling test)."""
    try:
        return client_frames(build(case), **limits)
    except InvalidRequestError as exc:
        return exc


def check_refusal(case: Case, error: InvalidRequestError) -> None:
    root = field_root(error.field)
    assert root in case.allowed_error_fields(), (
        f"error names {error.field!r}, but the hostile fields were {sorted(case.hostile)}: "
        f"{error}")
    assert str(error).startswith(f"invalid request: {error.field}: ")



def observed_request(**kwargs: Any) -> GenerateRequest:
    """A valid request with ``kwargs`` changed (``params``: SamplingParams changes)."""
    params = kwargs.pop("params", {})
    args: dict[str, Any] = {"request_id": "r1", "prompt_token_ids": [11, 22],
                            "sampling_params": SamplingParams(**{"max_tokens": 8, **params})}
    args.update(kwargs)
    return GenerateRequest(**args)


#: The cases of issue 12, item 3: each used to pass validation, then kill the engine's input
#: thread (deaf engine) or escape as a raw codec exception.
OBSERVED: list[tuple[dict[str, Any], str]] = [
    ({"lora_request": LoRARequest("a", "1")}, "lora_request.lora_int_id"),  # type: ignore[arg-type]
    ({"lora_request": LoRARequest("a", True)}, "lora_request.lora_int_id"),
    ({"lora_request": LoRARequest("a", 1, None)}, "lora_request.lora_path"),  # type: ignore[arg-type]
    ({"lora_request": LoRARequest("a", 1)}, "lora_request.lora_path"),  # vLLM asserts a path
    ({"lora_request": LoRARequest("a", 0, "/p")}, "lora_request.lora_int_id"),
    ({"lora_request": LoRARequest("a", 2**70, "/p")}, "lora_request.lora_int_id"),
    ({"params": {"logprobs": -1}}, "logprobs"),  # the whole vocabulary > max_logprobs=20
    ({"params": {"prompt_logprobs": -1}}, "prompt_logprobs"),
    ({"request_id": "r\udc80"}, "request_id"),
    ({"cache_salt": "salt\ud800"}, "cache_salt"),
    ({"trace_headers": {"traceparent": "\udfff"}}, "trace_headers['traceparent']"),
    ({"trace_headers": {"\udfff": "x"}}, "trace_headers['\\udfff']"),
    ({"params": {"max_tokens": 2**64}}, "max_tokens"),
    ({"params": {"top_k": 2**64}}, "top_k"),
    ({"params": {"min_tokens": 2**64}}, "min_tokens"),
    ({"params": {"seed": 2**64}}, "seed"),
    ({"priority": 2**64}, "priority"),
    ({"data_parallel_rank": 2**64}, "data_parallel_rank"),
    ({"arrival_time": 10**400}, "arrival_time"),
    ({"arrival_time": float("nan")}, "arrival_time"),
    ({"params": {"repetition_penalty": 10**400}}, "repetition_penalty"),
    ({"params": {"logit_bias": {5: 10**400}}}, "logit_bias[5]"),
    ({"params": {"extra_args": {"k": "\udc80"}}}, "extra_args['k']"),
    ({"params": {"extra_args": {"k": {frozenset(): 1}}}}, "extra_args['k'] key frozenset()"),
    ({"params": {"extra_args": {"k": np.int64(1)}}}, "extra_args['k']"),
    ({"params": {"extra_args": {"k": {"m": types.MappingProxyType({})}}}},
     "extra_args['k']['m']"),
]
