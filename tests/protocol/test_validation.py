"""The one request validation (``EngineCoreRequest.validate`` with ``SamplingParams``).

Whatever a user puts in a :class:`GenerateRequest`, the client either refuses it with an
:class:`InvalidRequestError` naming the field, or sends frames the mock engine's decoder (as
strict as vLLM 0.32's) accepts: no ``UnicodeEncodeError``, ``OverflowError``, ``TypeError``
or msgpack error escapes, and nothing that would deafen an engine leaves the client. The
differential version of this test, against vLLM's own decoder, is
tests/interop/test_validation_differential.py.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given

from anyio_genout import (
    EngineCoreRequest,
    InvalidRequestError,
    LoRARequest,
    SamplingParams,
)
from anyio_genout.protocol import AddRequest, decode_request, encode_add

from ._hostile_requests import (
    OBSERVED,
    Case,
    cases,
    check_refusal,
    client_frames,
    observed_request,
    run_client,
)
from ._hyp import fuzz_settings


def _decode(frames: list[bytes]) -> AddRequest:
    decoded = decode_request(frames)
    assert isinstance(decoded, AddRequest)
    return decoded


@fuzz_settings(250)
@given(case=cases())
def test_hostile_fields_are_refused_by_name_or_sent_decodably(case: Case) -> None:
    result = run_client(case)
    if isinstance(result, InvalidRequestError):
        check_refusal(case, result)
        return
    decoded = _decode(result)  # the mock's decoder: raises ProtocolError if it would die
    assert all(type(t) is int for t in decoded.request.prompt_token_ids)


def test_most_generated_cases_with_no_hostile_field_are_accepted() -> None:
    # Guard for the property above: the valid strategies really are valid.
    accepted = 0

    @fuzz_settings(100)
    @given(case=cases(max_hostile=0))
    def count(case: Case) -> None:
        nonlocal accepted
        result = run_client(case)
        assert not isinstance(result, InvalidRequestError), result
        accepted += 1

    count()
    assert accepted >= 100


@pytest.mark.parametrize(("kwargs", "field"), OBSERVED)
def test_observed_cases_are_refused_naming_the_field(kwargs: dict[str, Any],
                                                     field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client_frames(observed_request(**kwargs))
    assert info.value.field == field


@pytest.mark.parametrize("extra", [
    {"k": {(1, 2): 3}}, {"k": {1: "int key"}}, {"k": {None: 1, 1.5: 2, b"x": 3}},
    {"k": [b"bytes", bytearray(b"ba"), (1, (2, 3)), 2**64 - 1, -(2**63)]},
])
def test_extra_args_vllm_accepts_are_sent_and_decoded(extra: dict[str, Any]) -> None:
    """vLLM decodes extra_args as dict[str, Any]: below the top level, keys of any msgpack
    type (an array key becomes a tuple). The mock's decoder does the same."""
    decoded = _decode(client_frames(observed_request(params={"extra_args": extra})))
    got = decoded.request.sampling_params.extra_args
    assert got is not None and set(got) == set(extra)
    if extra == {"k": {(1, 2): 3}}:
        assert got == {"k": {(1, 2): 3}}


@pytest.mark.parametrize("prompt", [
    np.array([11, 22, 33], dtype=np.int64),
    np.array([11, 22, 33], dtype=np.int32),
    np.array([11, 22, 33], dtype=np.uint16),
    np.array([11, 22, 33], dtype=">i8"),
    [np.int64(11), np.int32(22), np.uint64(33)],
    (11, np.int16(22), 33),
])
def test_numpy_integer_prompts_are_accepted_and_sent_as_ints(prompt: Any) -> None:
    frames = client_frames(observed_request(prompt_token_ids=prompt))
    decoded = _decode(frames)
    assert decoded.request.prompt_token_ids == (11, 22, 33)
    assert all(type(t) is int for t in decoded.request.prompt_token_ids)


@pytest.mark.parametrize(("prompt", "field"), [
    (np.array([1.0, 2.0]), "prompt_token_ids[0]"),
    (np.array([True, False]), "prompt_token_ids[0]"),
    (np.array([[1, 2]]), "prompt_token_ids[0]"),
    (np.array(5), "prompt_token_ids"),
    (np.array([1, -1]), "prompt_token_ids[1]"),
    (np.array([1, 2**40]), "prompt_token_ids[1]"),
    ([1, np.float64(2.0)], "prompt_token_ids[1]"),
    ([1, np.bool_(True)], "prompt_token_ids[1]"),
    ([1, True], "prompt_token_ids[1]"),
    ([*range(40), 2000], "prompt_token_ids[40]"),  # a long prompt: the C-loop path
    ([*range(40), 1.5], "prompt_token_ids[40]"),
    ([*range(40), -3], "prompt_token_ids[40]"),
    (5, "prompt_token_ids"),
    ("abc", "prompt_token_ids"),
])
def test_bad_prompts_name_the_token(prompt: Any, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client_frames(observed_request(prompt_token_ids=prompt))
    assert info.value.field == field


def test_a_huge_prompt_is_refused_by_its_length_before_any_per_token_work() -> None:
    request = EngineCoreRequest(request_id="long", prompt_token_ids=tuple(range(10**6)),
                                sampling_params=SamplingParams(), arrival_time=0.0)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        with pytest.raises(InvalidRequestError, match="max_model_len=4096") as info:
            request.validate(vocab_size=32000, max_model_len=4096)
        best = min(best, time.perf_counter() - started)
    assert info.value.field == "prompt_token_ids"
    assert best < 0.005, f"{best * 1e3:.2f} ms"


def test_long_valid_prompts_take_the_fast_path_and_stay_exact() -> None:
    tokens = list(range(1000))
    request = EngineCoreRequest(request_id="x", prompt_token_ids=tokens,
                                sampling_params=SamplingParams(max_tokens=4), arrival_time=0.0)
    request.validate(vocab_size=1000, max_model_len=2000)
    with pytest.raises(InvalidRequestError) as info:
        request.validate(vocab_size=999, max_model_len=2000)
    assert info.value.field == "prompt_token_ids[999]"
    assert "999 is not in the vocabulary (0..998)" in str(info.value)


def test_logprobs_minus_one_follows_max_logprobs() -> None:
    """-1 is the whole vocabulary: allowed where max_logprobs is -1 (vLLM: the vocabulary
    size) or at least the vocabulary; remembered per (vocab_size, max_logprobs)."""
    params = SamplingParams(logprobs=-1, prompt_logprobs=-1)
    params.validate(vocab_size=1024, max_logprobs=-1)
    params.validate(vocab_size=16, max_logprobs=20)
    params.validate()  # no engine limits known
    with pytest.raises(InvalidRequestError, match="whole vocabulary"):
        params.validate(vocab_size=1024, max_logprobs=20)
    with pytest.raises(InvalidRequestError, match="whole vocabulary"):
        params.validate(vocab_size=None, max_logprobs=20)
    with pytest.raises(InvalidRequestError, match=r"at most 1024"):
        SamplingParams(logprobs=1025).validate(vocab_size=1024, max_logprobs=-1)


def test_validation_memo_is_per_limits_and_skipped_for_mutable_mappings() -> None:
    params = SamplingParams(logprobs=20)
    params.validate(vocab_size=1024, max_logprobs=20)
    with pytest.raises(InvalidRequestError, match="logprobs"):
        params.validate(vocab_size=1024, max_logprobs=10)
    extra: dict[str, Any] = {"k": 1}
    with_extra = SamplingParams(extra_args=extra)
    with_extra.validate()
    extra["bad"] = "\udc80"  # changed after the first check: checked again
    with pytest.raises(InvalidRequestError, match=r"extra_args\['bad'\]"):
        with_extra.validate()


def test_engine_request_validate_checks_every_wire_field() -> None:
    base = EngineCoreRequest(request_id="r", prompt_token_ids=[1],
                             sampling_params=SamplingParams(), arrival_time=1.0)
    for change, field in [
        ({"client_index": -1}, "client_index"),
        ({"client_index": 2**63}, "client_index"),
        ({"current_wave": 2**63}, "current_wave"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"external_req_id": "\udc80"}, "external_req_id"),
        ({"external_req_id": 5}, "external_req_id"),
        ({"arrival_time": True}, "arrival_time"),
        ({"arrival_time": float("inf")}, "arrival_time"),
        ({"sampling_params": None}, "sampling_params"),
        ({"lora_request": ("a", 1, "/p")}, "lora_request"),
        ({"trace_headers": [("a", "b")]}, "trace_headers"),
        ({"trace_headers": {1: "b"}}, "trace_headers"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            attrs.evolve(base, **change).validate()
        assert info.value.field == field, change
    encode_add(attrs.evolve(base, arrival_time=2**40, lora_request=LoRARequest("", 2**63 - 1,
                                                                              "/p")))


def test_a_huge_logit_bias_key_is_refused_by_name_not_by_pythons_digit_limit() -> None:
    # Building the field name once called repr() on the key: past 4300 digits Python raises
    # ValueError, which escaped instead of the error naming the field.
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(logit_bias={10**5000: 1.0}).validate(vocab_size=100)
    assert caught.value.field == "logit_bias[an integer of 16610 bits]"


@pytest.mark.parametrize(("extra_args", "field"), [
    ({10**5000: None}, "extra_args"),
    ({"a": {10**5000: 1}}, "extra_args['a'] key an integer of 16610 bits"),
    ({"a": {(1, 10**5000): 1}}, "extra_args['a'] key a tuple holding a huge integer[1]"),
])
def test_huge_integers_in_extra_args_keys_are_refused_by_name(extra_args: dict[object, object],
                                                              field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(extra_args=extra_args).validate()
    assert caught.value.field == field
