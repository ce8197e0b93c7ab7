"""encode -> decode is the identity: outputs, requests, handshake messages and arrays.

Arrays are checked for every supported dtype (numpy strings in both byte orders, torch names,
bfloat16 through float32 truncation) at the inline/aux-frame boundary, asserting where the
bytes went.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import msgpack
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from anyio_genout import InvalidRequestError, ProtocolError
from anyio_genout.protocol import (
    INLINE_THRESHOLD,
    AddRequest,
    DpControl,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineDead,
    EngineStatus,
    HandshakeAddresses,
    Logprobs,
    LoRARequest,
    PrefillStats,
    RequestBatch,
    RequestError,
    SamplingMask,
    SamplingParams,
    SchedulerStats,
    StatusMessage,
    UtilityOutput,
    UtilityReply,
    decode_array,
    decode_init,
    decode_outputs,
    decode_ready_response,
    decode_request,
    decode_status,
    encode_add,
    encode_array,
    encode_init,
    encode_outputs,
    encode_ready_response,
    encode_status,
)
from anyio_genout.protocol.output_decode import _decode_output
from anyio_genout.protocol.packing import pack, unpack

from ._hyp import fuzz_settings

# ------------------------------------------------------------------- strategies

_text = st.text(max_size=12)
_token = st.integers(0, 2**31 - 1)
_finite = st.floats(allow_nan=False, allow_infinity=False)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | _finite | _text,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(_text, children, max_size=3),
    max_leaves=6,
)
_str_map = st.dictionaries(_text, _json, max_size=3)


@st.composite
def _logprobs(draw: st.DrawFn, rows: int, prompt: bool = False) -> Logprobs:
    cols = draw(st.integers(1, 5))
    ids = draw(hnp.arrays(np.int32, (rows, cols), elements=st.integers(0, 2**31 - 1)))
    lps = draw(hnp.arrays(np.float32, (rows, cols), elements=st.floats(width=32)))
    high = 2**31 - 1 if prompt else 2**63 - 1
    ranks = draw(hnp.arrays(np.int32 if prompt else np.int64, (rows,),
                            elements=st.integers(1, high)))
    return Logprobs(ids, lps, ranks)


@st.composite
def _mask(draw: st.DrawFn, rows: int) -> SamplingMask:
    if rows == 1 and draw(st.booleans()):
        ids = draw(st.lists(_token, max_size=6))
        return SamplingMask(np.array(ids, np.int32))
    lengths = draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = draw(st.lists(_token, min_size=int(offsets[-1]), max_size=int(offsets[-1])))
    return SamplingMask(np.array(ids, np.int32), offsets)


_plain_dtypes = st.sampled_from(["<i4", "<f4", "<i8", ">f8", "|u1", "|b1", "<u2", "<c8"])


@st.composite
def _array(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(_plain_dtypes))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=12))
    elements: st.SearchStrategy[Any] | None = None
    if dtype.kind == "c":
        elements = st.complex_numbers(allow_nan=False, width=64)
    elif dtype.kind == "f":
        elements = st.floats(allow_nan=False, width=32 if dtype.itemsize == 4 else 64)
    return draw(hnp.arrays(dtype, shape, elements=elements))


@st.composite
def _output(draw: st.DrawFn, fields: int) -> EngineCoreOutput:
    tokens = draw(st.lists(_token, max_size=5))
    n = len(tokens)
    maybe = st.booleans()
    return EngineCoreOutput(
        request_id=draw(_text),
        new_token_ids=tokens,
        new_logprobs=draw(_logprobs(n)) if n and draw(maybe) else None,
        new_prompt_logprobs=draw(_logprobs(draw(st.integers(1, 80)), prompt=True))
        if draw(maybe) else None,
        pooling_output=draw(_array()) if draw(maybe) else None,
        finish_reason=draw(st.none() | st.sampled_from(EngineCoreFinishReason)),
        stop_reason=draw(st.none() | _token | _text),
        events=draw(st.none() | st.lists(st.builds(
            EngineCoreEvent, st.sampled_from(EngineCoreEventType), _finite), max_size=3)),
        kv_transfer_params=draw(st.none() | _str_map),
        ec_transfer_params=draw(st.none() | _str_map),
        trace_headers=draw(st.none() | st.dictionaries(_text, _text, max_size=3)),
        prefill_stats=draw(st.none() | st.builds(
            PrefillStats, *[st.integers(0, 2**40)] * 6)),
        routed_experts=draw(_array()) if draw(maybe) else None,
        num_nans_in_logits=draw(st.integers(0, 2**31)),
        mm_cache_miss_hashes=draw(st.none() | st.lists(_text, max_size=3)),
        new_sampling_mask=draw(_mask(n)) if n and draw(maybe) else None,
        spec_decode_metrics=draw(st.none() | _str_map),
        prompt_token_id_logprobs=draw(_array()) if draw(maybe) else None,
        error=draw(st.none() | st.builds(RequestError, _text, _text, st.booleans()))
        if fields == 19 else None,
    )


_stats = st.builds(
    SchedulerStats,
    num_running_reqs=st.integers(0, 2**20), num_waiting_reqs=st.integers(0, 2**20),
    num_skipped_waiting_reqs=st.integers(0, 2**20), step_counter=st.integers(0, 2**40),
    current_wave=st.integers(0, 2**20), kv_cache_usage=_finite,
    prefix_cache_queries=st.integers(0, 2**40), prefix_cache_hits=st.integers(0, 2**40),
    raw=st.just({"iteration_details": None, "kv_cache_eviction_events": []}),
)


@st.composite
def _message(draw: st.DrawFn, fields: int) -> EngineCoreOutputs:
    utility = None
    outputs = draw(st.lists(_output(fields), max_size=4))
    if not outputs and draw(st.booleans()):
        has_result = draw(st.booleans())
        utility = UtilityOutput(
            call_id=draw(st.integers(0, 2**64 - 1)),
            failure_message=draw(st.none() | _text),
            result=draw(_json) if has_result else None,
            has_result=has_result,
        )
    small = st.none() | st.integers(0, 2**31)
    return EngineCoreOutputs(
        engine_index=draw(st.integers(0, 2**15)),
        outputs=outputs,
        scheduler_stats=draw(st.none() | _stats),
        timestamp=draw(_finite),
        utility_output=utility,
        finished_requests=draw(st.none() | st.frozensets(_text, max_size=3)),
        wave_complete=draw(small),
        start_wave=draw(small),
        weight_version=draw(st.none() | _text),
    )


# ------------------------------------------------------------------- outputs


@pytest.mark.parametrize("fields", [18, 19])
@fuzz_settings(150)
@given(data=st.data())
def test_outputs_roundtrip(fields: int, data: st.DataObject) -> None:
    message = data.draw(_message(fields))
    frames = encode_outputs(message, fields=fields)
    assert len(plain := msgpack.unpackb(bytes(frames[0]), strict_map_key=False)) == 9
    assert all(len(row) == fields for row in plain[1])
    decoded = decode_outputs([bytes(f) for f in frames])
    if message.utility_output is not None:
        assert isinstance(decoded, UtilityReply)
        assert decoded.reply == message.utility_output
    elif not message.outputs and (message.wave_complete is not None
                                  or message.start_wave is not None):
        assert isinstance(decoded, DpControl)
    else:
        assert isinstance(decoded, RequestBatch)
    assert decoded.message == message
    for ours, theirs in zip(decoded.message.outputs, message.outputs, strict=True):
        assert ours.same_as(theirs)
        assert type(ours) is EngineCoreOutput and len(ours) == 19
    if message.scheduler_stats is not None:
        assert decoded.message.scheduler_stats is not None
        assert decoded.message.scheduler_stats.raw == message.scheduler_stats.to_wire()


@fuzz_settings(100)
@given(data=st.data())
def test_outputs_roundtrip_through_memoryviews(data: st.DataObject) -> None:
    message = data.draw(_message(18))
    frames = encode_outputs(message)
    decoded = decode_outputs([memoryview(bytes(f)) for f in frames])
    assert not isinstance(decoded, EngineDead)
    assert decoded.message == message


def test_big_arrays_travel_in_aux_frames() -> None:
    plp = Logprobs(np.arange(40 * 6, dtype=np.int32).reshape(40, 6),
                   np.zeros((40, 6), np.float32), np.ones(40, np.int32))
    message = EngineCoreOutputs(outputs=[EngineCoreOutput("p", [5], new_prompt_logprobs=plp)])
    frames = encode_outputs(message)
    assert [len(bytes(f)) for f in frames[1:]] == [960, 960]  # ranks: 160 bytes, inline
    wire = msgpack.unpackb(bytes(frames[0]), strict_map_key=False,
                           ext_hook=lambda c, d: msgpack.ExtType(c, d))[1][0][3]
    assert [w[0] for w in wire[:3]] == ["int32", "float32", "int32"]  # torch names
    assert (wire[0][2], wire[1][2]) == (1, 2)
    assert wire[2][2] == msgpack.ExtType(3, plp.ranks.tobytes())
    decoded = decode_outputs(frames)
    assert isinstance(decoded, RequestBatch)
    assert decoded.message == message


# ------------------------------------------------------------------- requests


@st.composite
def _sampling(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.none() | st.integers(1, 1000))
    vocab = st.integers(0, 1023)
    bias = st.floats(-100, 100, allow_nan=False)
    return SamplingParams(
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(st.floats(0.01, 10)),
        temperature=draw(st.sampled_from([0.0, 0, 1e-6, 1.0]) | st.floats(0, 2)),
        top_p=draw(st.floats(0.01, 1)),
        top_k=draw(st.integers(-1, 100)),
        min_p=draw(st.floats(0, 1)),
        seed=draw(st.none() | st.just(-1) | st.integers(-(2**63), 2**64 - 1)),
        stop_token_ids=draw(st.lists(vocab, max_size=4)),
        stop_token_sequences=draw(st.lists(st.lists(vocab, min_size=1, max_size=3),
                                           max_size=2)),
        ignore_eos=draw(st.booleans()),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens if max_tokens is not None else 50)),
        logprobs=draw(st.none() | st.integers(-1, 20)),
        prompt_logprobs=draw(st.none() | st.integers(-1, 20)),
        eos_token_id=draw(st.none() | vocab),
        bad_words_token_ids=draw(st.none() | st.lists(st.lists(vocab, min_size=1, max_size=3),
                                                      max_size=2)),
        logit_bias=draw(st.none() | st.dictionaries(vocab, bias | st.integers(-5, 5),
                                                    max_size=3)),
        allowed_token_ids=draw(st.none() | st.lists(vocab, min_size=1, max_size=4)),
        skip_reading_prefix_cache=draw(st.none() | st.booleans()),
        extra_args=draw(st.none() | _str_map),
    )


@st.composite
def _request(draw: st.DrawFn) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=draw(st.text(min_size=1, max_size=20)),
        prompt_token_ids=draw(st.lists(st.integers(0, 1023), min_size=1, max_size=20)),
        sampling_params=draw(_sampling()),
        arrival_time=draw(st.floats(0, 2e9) | st.integers(0, 2**31)),
        max_tokens=draw(st.none() | st.integers(1, 1000)),
        lora_request=draw(st.none() | st.builds(LoRARequest, _text, st.integers(1, 2**31),
                                                _text)),
        cache_salt=draw(st.none() | st.text(min_size=1, max_size=8)),
        data_parallel_rank=draw(st.none() | st.integers(0, 8)),
        client_index=draw(st.integers(0, 100)),
        current_wave=draw(st.integers(0, 100)),
        priority=draw(st.integers(-(2**63), 2**63 - 1)),
        trace_headers=draw(st.none() | st.dictionaries(_text, _text, max_size=3)),
        external_req_id=draw(st.none() | _text),
    )


def _expected_params(request: EngineCoreRequest) -> SamplingParams:
    """What survives the wire: vLLM's __post_init__ normalisations, as to_wire documents."""
    p = request.sampling_params
    tokens = request.max_tokens if request.max_tokens is not None else p.max_tokens
    greedy = p.temperature < 1e-5
    return attrs.evolve(
        p,
        temperature=float(p.temperature),
        top_p=1.0 if greedy else p.top_p,
        top_k=0 if greedy else p.top_k,
        min_p=0.0 if greedy else p.min_p,
        seed=None if p.seed == -1 else p.seed,
        stop_token_ids=tuple(dict.fromkeys(p.stop_token_ids)),
        stop_token_sequences=(),  # matched by the client, never sent
        max_tokens=16 if tokens is None else tokens,
        # An ignored EOS travels only as an extra stop id of _all_stop_token_ids.
        eos_token_id=(None if p.ignore_eos and p.eos_token_id in p.stop_token_ids
                      else p.eos_token_id),
        bad_words_token_ids=p.bad_words_token_ids or None,
        logit_bias={k: float(v) for k, v in p.logit_bias.items()} if p.logit_bias else None,
        extra_args=p.extra_args or None,
        skip_reading_prefix_cache=(p.prompt_logprobs is not None
                                   if p.skip_reading_prefix_cache is None
                                   else p.skip_reading_prefix_cache),
    )


@fuzz_settings(200)
@given(request=_request())
def test_request_roundtrip(request: EngineCoreRequest) -> None:
    try:
        request.validate(vocab_size=1024, max_logprobs=20)
    except InvalidRequestError:
        assume(False)
    frames = encode_add(request)
    decoded = decode_request(frames)
    assert isinstance(decoded, AddRequest)
    got = decoded.request
    for field in ("request_id", "prompt_token_ids", "lora_request", "cache_salt",
                  "data_parallel_rank", "client_index", "current_wave", "priority",
                  "trace_headers", "external_req_id"):
        assert getattr(got, field) == getattr(request, field), field
    assert got.arrival_time == float(request.arrival_time)
    assert type(got.arrival_time) is float
    expected = _expected_params(request)
    assert got.sampling_params == expected
    assert got.max_tokens == expected.max_tokens
    assert decoded.sampling_wire == unpack(frames[1], "x")[3]
    # A decoded request re-encodes to the very same bytes (to_wire is a fixed point).
    assert encode_add(got) == frames


def test_valid_requests_are_common_enough() -> None:
    # Guard for the assume() above: most generated requests are valid.
    valid = 0

    @fuzz_settings(50)
    @given(request=_request())
    def count(request: EngineCoreRequest) -> None:
        nonlocal valid
        try:
            request.validate(vocab_size=1024, max_logprobs=20)
            valid += 1
        except InvalidRequestError:
            pass

    count()
    assert valid >= 25


# ------------------------------------------------------------------- handshake

_reserved = {"status", "local", "headless"}


@fuzz_settings(100)
@given(status=st.sampled_from(EngineStatus), local=st.booleans(), headless=st.booleans(),
       extra=st.dictionaries(_text.filter(lambda k: k not in _reserved), _json, max_size=3))
def test_status_roundtrip(status: EngineStatus, local: bool, headless: bool,
                          extra: dict[str, Any]) -> None:
    message = StatusMessage(status, local, headless, extra)
    assert decode_status(encode_status(message)) == message


_address = st.from_regex(r"tcp://127\.0\.0\.1:[0-9]{1,5}", fullmatch=True) | \
    st.text(min_size=1, max_size=30)


@fuzz_settings(100)
@given(addresses=st.builds(
    HandshakeAddresses,
    inputs=st.lists(_address, min_size=1, max_size=3),
    outputs=st.lists(_address, min_size=1, max_size=3),
    coordinator_input=st.none() | _address,
    coordinator_output=st.none() | _address,
    frontend_stats_publish_address=st.none() | _address,
    parallel_config=st.dictionaries(_text, st.integers(-(2**63), 2**64 - 1) | _text
                                    | st.lists(st.integers(0, 9)),
                                    max_size=3),
))
def test_init_roundtrip(addresses: HandshakeAddresses) -> None:
    assert decode_init(encode_init(addresses)) == addresses


@fuzz_settings(100)
@given(response=st.builds(
    EngineCoreReadyResponse,
    max_model_len=st.integers(1, 2**31), num_gpu_blocks=st.integers(0, 2**31),
    block_size=st.integers(1, 2**10), dtype=st.sampled_from(["float32", "bfloat16"]),
    vllm_version=st.sampled_from(["0.32.0", "0.33.1", "0.34.0.dev1"]),
    data_parallel_rank=st.integers(0, 64), max_num_seqs=st.integers(1, 2**12),
    max_num_batched_tokens=st.integers(0, 2**20), data_parallel_size=st.integers(1, 64),
    world_size=st.integers(1, 64), instance_id=_text, supports_lora=st.booleans(),
    max_loras=st.integers(0, 64), kv_cache_size_tokens=st.none() | st.integers(0, 2**40),
    enable_sleep_mode=st.booleans(),
))
def test_ready_response_roundtrip(response: EngineCoreReadyResponse) -> None:
    data = encode_ready_response(response)
    decoded = decode_ready_response(data)
    assert decoded == response
    assert list(decoded.raw)[:3] == ["max_model_len", "num_gpu_blocks", "block_size"]


# ------------------------------------------------------------------- arrays

# What numpy's dtype.str says: "|" for one-byte types, "<" or ">" for the others.
_NUMPY_NAMES = ["|b1", "|i1", "|u1"] + [
    order + code for code in ("i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")
    for order in "<>"
]
_TORCH_NAMES = {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2", "uint16": "<u2",
    "int32": "<i4", "uint32": "<u4", "int64": "<i8", "uint64": "<u8", "float16": "<f2",
    "float32": "<f4", "float64": "<f8", "complex64": "<c8", "complex128": "<c16",
}
_CASES = [(name, name) for name in _NUMPY_NAMES] + list(_TORCH_NAMES.items())


def _counts(itemsize: int) -> list[int]:
    """Element counts giving the nbytes right below, at (or just past) and past 256."""
    below = (INLINE_THRESHOLD - 1) // itemsize
    at = -(-INLINE_THRESHOLD // itemsize)
    return [below, at, at + 1]


def _roundtrip(value: list[Any], aux: list[bytes | memoryview]) -> np.ndarray[Any, Any]:
    frames: list[bytes] = [pack([value])] + [bytes(a) for a in aux[1:]]
    return decode_array(unpack(frames[0], "test")[0], frames, "test")


def _assert_placement(value: list[Any], aux: list[bytes | memoryview], raw: bytes) -> None:
    if len(raw) < INLINE_THRESHOLD:
        assert isinstance(value[2], msgpack.ExtType) and value[2].code == 3
        assert value[2].data == raw
        assert len(aux) == 1
    else:
        assert value[2] == 1
        assert len(aux) == 2 and bytes(aux[1]) == raw


@pytest.mark.parametrize(("name", "numpy_name"), _CASES, ids=[c[0] for c in _CASES])
@fuzz_settings(12)
@given(data=st.data())
def test_array_roundtrip_at_the_aux_threshold(name: str, numpy_name: str,
                                              data: st.DataObject) -> None:
    dtype = np.dtype(numpy_name)
    count = data.draw(st.sampled_from(_counts(dtype.itemsize)), label="count")
    shape = data.draw(st.sampled_from([(count,), (1, count)]), label="shape")
    array = data.draw(hnp.arrays(dtype, shape))
    raw = array.tobytes()
    assert len(raw) in (255, 256, 257) or dtype.itemsize > 1
    aux: list[bytes | memoryview] = [b""]
    value = encode_array(array, aux, dtype_name=None if name == numpy_name else name)
    assert value[0] == name and value[1] == list(shape)
    _assert_placement(value, aux, raw)
    decoded = _roundtrip(value, aux)
    assert decoded.dtype == dtype and decoded.shape == shape
    assert decoded.tobytes() == raw  # bit-exact, NaN payloads included
    assert not decoded.flags.writeable
    # Without an aux list everything travels inline.
    inline = encode_array(array, None, dtype_name=None if name == numpy_name else name)
    assert isinstance(inline[2], msgpack.ExtType)
    assert _roundtrip(inline, [b""]).tobytes() == raw


@fuzz_settings(60)
@given(data=st.data())
def test_bfloat16_roundtrip_is_float32_truncation(data: st.DataObject) -> None:
    count = data.draw(st.sampled_from(_counts(2)), label="count")
    array = data.draw(hnp.arrays(np.float32, (count,), elements=st.floats(width=32)))
    aux: list[bytes | memoryview] = [b""]
    value = encode_array(array, aux, dtype_name="bfloat16")
    assert value[0] == "bfloat16" and value[1] == [count]
    expected_bits = (array.view(np.uint32) >> 16).astype("<u2")
    _assert_placement(value, aux, expected_bits.tobytes())
    decoded = _roundtrip(value, aux)
    assert decoded.dtype == np.float32 and decoded.shape == (count,)
    truncated = (array.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert decoded.tobytes() == truncated.tobytes()
    assert not decoded.flags.writeable
    finite = np.isfinite(truncated)
    assert np.array_equal(decoded[finite], array[finite].astype(np.float32).view(np.uint32)
                          .__and__(0xFFFF0000).view(np.float32))


@pytest.mark.parametrize("numpy_name", ["<i4", ">f8", "|b1", "<c16"])
def test_zero_dimensional_and_empty_arrays(numpy_name: str) -> None:
    for array in (np.array(1, dtype=numpy_name), np.zeros((0, 3), dtype=numpy_name),
                  np.zeros((2, 0), dtype=numpy_name)):
        aux: list[bytes | memoryview] = [b""]
        value = encode_array(array, aux)
        assert value[1] == list(array.shape)
        assert isinstance(value[2], msgpack.ExtType) and len(aux) == 1
        decoded = _roundtrip(value, aux)
        assert decoded.shape == array.shape and decoded.dtype == array.dtype
        assert np.array_equal(decoded, array)


def test_non_contiguous_arrays_are_copied_first() -> None:
    array = np.arange(200, dtype="<i8").reshape(10, 20)[:, ::2]
    aux: list[bytes | memoryview] = [b""]
    value = encode_array(array, aux)
    assert value[1] == [10, 10] and value[2] == 1
    assert np.array_equal(_roundtrip(value, aux), array)
    assert math.prod(array.shape) * 8 == len(bytes(aux[1]))


@pytest.mark.parametrize("name", ["<b1", ">b1", "<i1", ">i1", "<u1", ">u1"])
def test_one_byte_types_also_decode_with_a_byte_order(name: str) -> None:
    array = decode_array([name, [3], msgpack.ExtType(3, b"\x00\x01\x02")], [b""], "x")
    assert array.dtype == np.dtype(name) and array.tolist() == np.frombuffer(
        b"\x00\x01\x02", name).tolist()


@pytest.mark.parametrize("fields", [18, 19])
def test_plain_and_special_rows_keep_their_order(fields: int) -> None:
    # Plain decode steps take the fast path, the others the full decoder; order is kept.
    outputs = []
    for i in range(40):
        if i % 7 == 3:
            outputs.append(EngineCoreOutput(f"r{i}", [i], finish_reason=EngineCoreFinishReason.STOP,
                                            stop_reason=i))
        elif i % 11 == 5:
            outputs.append(EngineCoreOutput(f"r{i}", [], events=[
                EngineCoreEvent(EngineCoreEventType.QUEUED, 1.0)]))
        else:
            outputs.append(EngineCoreOutput(f"r{i}", [i, i + 1], num_nans_in_logits=i % 2))
    message = EngineCoreOutputs(outputs=outputs, timestamp=5.0)
    decoded = decode_outputs(encode_outputs(message, fields=fields))
    assert isinstance(decoded, RequestBatch)
    assert decoded.message == message
    assert [type(o) for o in decoded.message.outputs] == [EngineCoreOutput] * 40
    assert [o.request_id for o in decoded.message.outputs] == [f"r{i}" for i in range(40)]
    assert all(len(o) == 19 for o in decoded.message.outputs)


_PREFILL_WIRE = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional={k: st.one_of(st.integers(0, 2**20), st.text(max_size=2),
                                                      st.none())
                                         for k in ("num_prompt_tokens", "num_cached_tokens",
                                                   "num_computed_tokens")}),
    st.integers(-(2**63), 2**63 - 1), st.lists(st.integers(0, 9), max_size=2),
)


@given(
    finish=st.one_of(st.none(), st.integers(-1, 8), st.booleans(), st.text(max_size=3)),
    stop=st.one_of(st.none(), st.integers(0, 2**31), st.text(max_size=3), st.floats(),
                   st.lists(st.integers(0, 9), max_size=1)),
    prefill=_PREFILL_WIRE,
    fields=st.sampled_from([18, 19]),
)
def test_rows_that_start_or_end_a_request_decode_like_any_other_row(
        finish: Any, stop: Any, prefill: Any, fields: int) -> None:
    """finish_reason, stop_reason and prefill_stats take a quicker path than other fields;
    valid or not, a row decodes exactly as the full decoder (which names a bad field) says."""
    row = ["req-1", [1, 2], None, None, None, finish, stop, None, None, None, None, prefill,
           None, 0, None, None, None, None, None][:fields]
    message = pack([0, [list(row)], None, 1.0, None, None, None, None, None])
    try:
        expected: object = _decode_output(list(row), [b""], 0)
    except ProtocolError as exc:
        expected = str(exc)
    try:
        decoded = decode_outputs([message])
        assert isinstance(decoded, RequestBatch)
        got: object = decoded.message.outputs[0]
    except ProtocolError as exc:
        got = str(exc)
    assert got == expected
    if isinstance(got, EngineCoreOutput):
        assert type(got) is EngineCoreOutput and len(got) == 19
        assert [type(v) for v in got] == [type(v) for v in expected]  # type: ignore[attr-defined]
