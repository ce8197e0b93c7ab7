"""Hostile input: the decoders raise ProtocolError (HandshakeError for the handshake) or succeed.

Whatever a peer sends (random bytes, random multipart messages, golden frames with flipped
bits, truncated, or with any value swapped for one of the wrong type), the decoders must never
leak IndexError, KeyError, TypeError, ValueError, RecursionError, a numpy warning or anything
else. A few explicit cases pin the error messages, which name the struct and field. Then
``SamplingParams.validate``: every invalid field raises InvalidRequestError naming it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from anyio_genout import (
    HandshakeError,
    InvalidRequestError,
    ProtocolError,
)
from anyio_genout.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    Logprobs,
    RequestBatch,
    SamplingMask,
    SamplingParams,
    as_output,
    decode_array,
    decode_batch_or_other,
    decode_init,
    decode_outputs,
    decode_ready_response,
    decode_request,
    decode_status,
    encode_outputs,
)
from anyio_genout.protocol.outputs import PLAIN_NONES
from anyio_genout.protocol.requests import REQUEST_FIELDS

from ._golden import Message, find, messages, plain_unpack
from ._hyp import fuzz_settings

EOS = "variant-eos-stop-logprobs"



def _pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


# ------------------------------------------------------------------- harness


def _outputs(frames: list[bytes]) -> None:
    """Both output decoders accept or refuse ``frames`` alike, and agree on the result."""
    try:
        classified: object = decode_outputs(frames)
    except ProtocolError as exc:
        classified = str(exc)
    try:
        fast: object = decode_batch_or_other(frames)
    except ProtocolError as exc:
        fast = str(exc)
    if type(fast) is tuple:
        assert isinstance(classified, RequestBatch)
        m = classified.message
        assert m.utility_output is None and m.wave_complete is None and m.start_wave is None
        # repr: NaN (which hostile input may carry) is equal to nothing, not even itself.
        # The fast decoder leaves a plain output as its row (a PlainRow list).
        engine, outputs, stats, timestamp, finished = fast
        assert all(type(o) is EngineCoreOutput or
                   (type(o) is list and o.count(None) == PLAIN_NONES) for o in outputs)
        fast = (engine, [as_output(o) for o in outputs], stats, timestamp, finished)
        assert repr(fast) == repr((m.engine_index, m.outputs, m.scheduler_stats, m.timestamp,
                                   m.finished_requests))
    elif isinstance(fast, str):
        assert fast == classified
    else:
        assert type(fast) is type(classified)


def _request(frames: list[bytes]) -> None:
    try:
        decode_request(frames)
    except ProtocolError:
        pass


def _status(data: bytes) -> None:
    try:
        decode_status(data)
    except (ProtocolError, HandshakeError):
        pass


def _init(data: bytes) -> None:
    try:
        decode_init(data)
    except (ProtocolError, HandshakeError):
        pass


def _ready(data: bytes) -> None:
    try:
        decode_ready_response(data)
    except ProtocolError:
        pass


def _any_decoder(frames: list[bytes]) -> None:
    """Feed a multipart message to every decoder that takes one."""
    _outputs(frames)
    _request(frames)
    if frames:
        _status(frames[-1])
        _init(frames[-1])
        _ready(frames[-1])


# ------------------------------------------------------------------- golden material

_OUTPUTS = [m for m in messages("e") if "ENGINE_CORE_DEAD" not in m.name]
_REQUESTS = messages("c")
_HANDSHAKE = messages("h")


def _with_arrays() -> list[Message]:
    found = []
    for m in _OUTPUTS:
        rows = plain_unpack(m.frames[0])[1]
        if any(r[2] is not None or r[3] is not None for r in rows):
            found.append(m)
    return found


_ARRAYS = _with_arrays()


def _decoder_for(m: Message) -> Callable[[list[bytes]], None]:
    """How to feed (possibly mutated) frames of a golden message to its decoder."""
    if m.name.startswith("e"):
        return _outputs
    if m.name.startswith("c"):
        return lambda frames: _request(frames[1:])
    if m.name.startswith("h4"):
        return lambda frames: _ready(frames[-1])
    if m.name.startswith("h2"):
        return lambda frames: _init(frames[-1])
    return lambda frames: _status(frames[-1])


_GOLDEN = _OUTPUTS + _REQUESTS + _HANDSHAKE


def _sample_golden(messages_: list[Message]) -> st.SearchStrategy[Message]:
    # Keep a spread of kinds without parametrizing over 250 messages.
    picked = messages_[::7] + [m for m in messages_ if m.name[:3] in ("c15", "h2_", "h4_")]
    picked += _ARRAYS
    return st.sampled_from(sorted(set(picked), key=str))


# ------------------------------------------------------------------- raw bytes


@fuzz_settings(150)
@given(data=st.binary(max_size=1024))
def test_random_bytes(data: bytes) -> None:
    _outputs([data])
    for kind in (b"\x00", b"\x01", b"\x02", b"\x03", b"\x09"):
        _request([kind, data])
    _status(data)
    _init(data)
    _ready(data)


@fuzz_settings(150)
@given(frames=st.lists(st.binary(max_size=200), max_size=5))
def test_random_multipart_messages(frames: list[bytes]) -> None:
    _any_decoder(frames)


@fuzz_settings(150)
@given(prefix=st.sampled_from([b"\x99", b"\x93", b"\xdc\x00\x12", b"\x94\x00\xcf", b"\x81"]),
       rest=st.binary(max_size=300))
def test_random_bytes_after_a_plausible_header(prefix: bytes, rest: bytes) -> None:
    _any_decoder([prefix + rest])
    _request([b"\x00", prefix + rest])


# ------------------------------------------------------------------- mutated frames


@fuzz_settings(150)
@given(m=_sample_golden(_GOLDEN), data=st.data())
def test_bit_flips(m: Message, data: st.DataObject) -> None:
    frames = list(m.frames)
    index = data.draw(st.integers(0, len(frames) - 1), label="frame")
    frame = bytearray(frames[index])
    if not frame:
        return
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        position = data.draw(st.integers(0, len(frame) - 1), label="byte")
        frame[position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    frames[index] = bytes(frame)
    _decoder_for(m)(frames)


@fuzz_settings(150)
@given(m=_sample_golden(_GOLDEN), data=st.data())
def test_truncations_and_splices(m: Message, data: st.DataObject) -> None:
    frames = list(m.frames)
    index = data.draw(st.integers(0, len(frames) - 1), label="frame")
    frame = frames[index]
    cut = data.draw(st.integers(0, len(frame)), label="cut")
    how = data.draw(st.sampled_from(["truncate", "drop-head", "splice", "duplicate"]))
    if how == "truncate":
        frames[index] = frame[:cut]
    elif how == "drop-head":
        frames[index] = frame[cut:]
    elif how == "splice":
        frames[index] = frame[:cut] + data.draw(st.binary(max_size=16)) + frame[cut:]
    else:
        frames[index] = frame[:cut] + frame
    if data.draw(st.booleans(), label="drop a frame") and len(frames) > 1:
        del frames[data.draw(st.integers(0, len(frames) - 1))]
    _decoder_for(m)(frames)


# ------------------------------------------------------------------- value-level mutations

_EXT = [msgpack.ExtType(1, b"\x80\x04N."), msgpack.ExtType(2, b""), msgpack.ExtType(9, b"abc"),
        msgpack.ExtType(3, b"\x01\x00\x00\x00"), msgpack.Timestamp(1, 0)]


def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
    st.text(max_size=12), st.binary(max_size=12), st.sampled_from(_EXT),
)
_hostile = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3)), children, max_size=4),
    max_leaves=8,
) | st.sampled_from([  # builders, not shared objects: a later mutation may edit the value
    lambda: _deep(200), lambda: _deep(900), lambda: [None] * 30,
    lambda: {"type": [1], "timestamp": 1.0},
]).map(lambda build: build())
_arrays = st.builds(
    lambda dtype, shape, data: [dtype, shape, data],
    st.sampled_from(["<i4", "<f4", "<i8", "int32", "float32", "bfloat16", "|b1", ">f8", "<U4",
                     "<M8", "O", "", "<(2)i4", "float128", 5, None]),
    st.one_of(
        st.lists(st.integers(-1, 5), max_size=3),
        st.sampled_from([[2**40 - 1, 2**40 - 1], [2**39] * 3, [0, 2**40 - 1, 2**40 - 1],
                         [1] * 33, [1] * 65, [2**64 - 1], [-1], [1.5], "x", None]
                        ).map(copy.copy),
    ),
    st.one_of(st.integers(-2, 5), st.binary(max_size=24).map(lambda b: msgpack.ExtType(3, b)),
              st.sampled_from(_EXT), st.none(), st.text(max_size=3)),
)
_replacement = st.one_of(_hostile, _arrays, st.lists(_arrays, min_size=1, max_size=5))


def _paths(value: Any, path: tuple[Any, ...] = (), limit: int = 400) -> Iterator[tuple[Any, ...]]:
    """Paths to every node of a decoded msgpack tree (containers first)."""
    stack = [(path, value)]
    count = 0
    while stack and count < limit:
        here, node = stack.pop()
        yield here
        count += 1
        if isinstance(node, list):
            stack.extend(((*here, i), v) for i, v in enumerate(node))
        elif isinstance(node, dict):
            stack.extend(((*here, k), v) for k, v in node.items())


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _mutate(tree: Any, path: tuple[Any, ...], how: str, new: Any, other: int) -> Any:
    """Apply one structural mutation at ``path``; returns the new root."""
    if not path:
        return new
    parent = _get(tree, path[:-1])
    key = path[-1]
    if how == "replace":
        parent[key] = new
    elif isinstance(parent, list):
        if how == "delete":
            del parent[key]
        elif how == "duplicate":
            parent.insert(key, copy.deepcopy(parent[key]))
        elif how == "swap":
            j = other % len(parent)
            parent[key], parent[j] = parent[j], parent[key]
        elif how == "truncate":
            del parent[key:]
        else:  # extend
            parent.append(new)
    elif isinstance(parent, dict):
        if how == "delete":
            del parent[key]
        else:
            parent[(key, "renamed") if how == "swap" else f"{key}_"] = parent.pop(key)
    return tree


def _mutated(m: Message, data: st.DataObject) -> list[bytes]:
    frames = list(m.frames)
    index = 0 if m.name.startswith("e") else len(frames) - 1
    tree = plain_unpack(frames[index])
    paths = list(_paths(tree))
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(paths), label="path")
        how = data.draw(st.sampled_from(
            ["replace", "replace", "replace", "delete", "duplicate", "swap", "truncate",
             "extend"]), label="how")
        new = data.draw(_replacement, label="new")
        other = data.draw(st.integers(0, 30), label="other")
        try:
            tree = _mutate(tree, path, how, new, other)
        except (KeyError, IndexError, TypeError):
            continue  # the path no longer exists after an earlier mutation
        paths = list(_paths(tree))
    try:
        frames[index] = _pack(tree)
    except (TypeError, ValueError, OverflowError):  # e.g. a list key made by "swap" on a map
        frames[index] = _pack(None)
    return frames


@fuzz_settings(150)
@given(m=_sample_golden(_GOLDEN), data=st.data())
def test_value_level_mutations(m: Message, data: st.DataObject) -> None:
    _decoder_for(m)(_mutated(m, data))


@fuzz_settings(300)
@given(m=st.sampled_from(_ARRAYS), data=st.data())
def test_value_level_mutations_of_logprobs_frames(m: Message, data: st.DataObject) -> None:
    _outputs(_mutated(m, data))


_dtypes = st.one_of(
    st.sampled_from(["<i4", ">i4", "<f4", "<i8", "int32", "float32", "bfloat16", "|b1", ">f8",
                     "<c8", "<U4", "<M8", "O", "", "<(2)i4", "float128", "<f 4", "=i4",
                     "|71)X3", "<(,-6mu[", ">a64", 5, None]),
    st.text(alphabet="<>|=ibufcSUVMmOa?e0123456789(),[]: ", max_size=8),
)
_shapes = st.one_of(
    st.lists(st.integers(-2, 41), max_size=3),
    st.lists(st.sampled_from([0, 1, 2, 6, 40, 2**20, 2**39, 2**40 - 1, 2**40, 2**64 - 1]),
             max_size=4),
    st.integers(20, 80).map(lambda n: [1] * n),
    st.sampled_from(["x", None, 5, [1.5], [True]]),
)
_data = st.one_of(
    st.integers(-2, 5),
    st.binary(max_size=1000).map(lambda b: msgpack.ExtType(3, b)),
    st.sampled_from(_EXT), st.none(), st.text(max_size=3), st.binary(max_size=8),
)


@fuzz_settings(400)
@given(m=st.sampled_from(_ARRAYS), data=st.data())
def test_hostile_array_triples_in_logprobs(m: Message, data: st.DataObject) -> None:
    frames = list(m.frames)
    tree = plain_unpack(frames[0])
    row = tree[1][0]
    field = 2 if row[2] is not None else 3
    triples = [i for i, a in enumerate(row[field]) if isinstance(a, list)]
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        which = data.draw(st.sampled_from(triples), label="array")
        part = data.draw(st.sampled_from(["dtype", "shape", "data", "all", "extra"]))
        triple = row[field][which]
        if part == "dtype":
            triple[0] = data.draw(_dtypes)
        elif part == "shape":
            triple[1] = data.draw(_shapes)
        elif part == "data":
            triple[2] = data.draw(_data)
        elif part == "all":
            row[field][which] = [data.draw(_dtypes), data.draw(_shapes), data.draw(_data)]
        else:
            row[field] = [*row[field], data.draw(_replacement)]
    frames[0] = _pack(tree)
    if data.draw(st.booleans(), label="drop aux frames"):
        frames = frames[:1]
    _outputs(frames)


@fuzz_settings(300)
@given(
    tokens=st.integers(0, 4),
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
    offsets=st.none() | st.lists(st.integers(-3, 10) | st.sampled_from([2**62, -(2**62)]),
                                 max_size=6),
    ids_dtype=st.sampled_from(["<i4", "<i8", "<u4", "<f4", "|b1"]),
    offsets_dtype=st.sampled_from(["<i8", "<u8", "<i4", "<f8"]),
    cu=st.none() | st.just([0, 1]),
)
def test_hostile_sampling_masks(tokens: int, ids: list[int], offsets: list[int] | None,
                                ids_dtype: str, offsets_dtype: str, cu: Any) -> None:
    def arr(values: list[int], dtype: str) -> list[Any]:
        data = np.array(values, dtype=np.int64).astype(dtype, casting="unsafe").tobytes()
        return [dtype, [len(values)], msgpack.ExtType(3, data)]

    mask = [arr(ids, ids_dtype), None if offsets is None else arr(offsets, offsets_dtype), cu]
    row = ["m", list(range(tokens))] + [None] * 11 + [0, None, mask, None, None]
    try:
        decoded = decode_outputs([_pack([0, [row], None, 0.0, None, None, None, None, None])])
    except ProtocolError:
        return
    # Accepted: then it is a consistent CSR mask of token ids. (Whether it has one row per
    # new token is checked per request by the generate layer, not by the decoder.)
    assert isinstance(decoded, RequestBatch)
    (output,) = decoded.message.outputs
    assert output.new_sampling_mask is not None
    rows = output.new_sampling_mask.rows
    assert sum(len(r) for r in rows) == len(ids)
    assert all(t >= 0 for r in rows for t in r)


_WRONG: list[Any] = [None, True, False, -1, 0, 2**64 - 1, -(2**63), 1.5, math.nan, "x", "",
                     b"x", [], {}, [[1]], [None] * 20, {"a": 1}, {1: 2}, _deep(300), *_EXT]


def _field_paths(tree: list[Any]) -> list[tuple[Any, ...]]:
    paths: list[tuple[Any, ...]] = [(i,) for i in range(9)]
    for r, row in enumerate(tree[1][:2]):
        paths += [(1, r)] + [(1, r, i) for i in range(len(row))]
        if isinstance(row[7], list):
            paths += [(1, r, 7, 0), (1, r, 7, 0, "type"), (1, r, 7, 0, "timestamp")]
        if isinstance(row[11], dict):
            paths += [(1, r, 11, k) for k in row[11]]
        for f in (2, 3):
            if isinstance(row[f], list):
                for a in range(len(row[f])):
                    paths.append((1, r, f, a))
                    if isinstance(row[f][a], list):
                        paths += [(1, r, f, a, j) for j in range(3)]
    if isinstance(tree[2], dict):
        paths += [(2, k) for k in tree[2]] + [(2, "prefix_cache_stats", "queries")]
    if isinstance(tree[4], list):
        paths += [(4, i) for i in range(len(tree[4]))] + [(4, 2, 0)]
    return paths


def _field_cases() -> list[tuple[Message, tuple[Any, ...]]]:
    picks = [find(".", "e001"), find(".", "e023_output_utility"), find(".", "e016"),
             find(EOS, "e021"), find(EOS, "e025"), find("variant-sigterm-inflight-enginecore",
                                                        "e012")]
    return [(m, path) for m in picks for path in _field_paths(plain_unpack(m.frames[0]))]


@pytest.mark.parametrize(("m", "path"), _field_cases(),
                         ids=[f"{m.name[:4]}{list(p)}" for m, p in _field_cases()])
def test_wrong_type_in_every_field(m: Message, path: tuple[Any, ...]) -> None:
    for wrong in _WRONG:
        frames = list(m.frames)
        tree = plain_unpack(frames[0])
        _get(tree, path[:-1])[path[-1]] = wrong
        frames[0] = _pack(tree)
        _outputs(frames)


def _request_cases() -> list[tuple[Message, int]]:
    cases = []
    for m in [find(".", "c06"), find(EOS, "c22"), find(".", "c07"), find(".", "c10")]:
        payload = plain_unpack(m.frames[2])
        cases += [(m, i) for i in range(len(payload))]
    return cases


def _refusal(decode: Callable[[list[bytes]], object], frames: list[bytes]) -> str | None:
    """None if ``decode`` accepts ``frames``, else its ProtocolError's message."""
    try:
        decode(frames)
    except ProtocolError as exc:
        return str(exc)
    return None


def _int64(v: Any) -> bool:  # msgspec's int: not a bool, within int64 .. uint64
    return type(v) is int and -(2**63) <= v <= 2**64 - 1


def _str(v: Any) -> bool:
    return type(v) is str


def _or_nil(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _bool(v: Any) -> bool:
    return type(v) is bool


#: What vLLM 0.32's msgspec decoder accepts in EngineCoreRequest's scalar fields (their
#: types in tests/data/vllm-wire/field-dump.txt): the engine decoder must refuse exactly the
#: rest, or an engine would take (or choke on) what vLLM refuses.
_ADD_SCALARS: dict[str, Callable[[Any], bool]] = {
    "request_id": _str, "arrival_time": lambda v: type(v) is float or _int64(v),
    "cache_salt": _or_nil(_str), "data_parallel_rank": _or_nil(_int64),
    "client_index": _int64, "current_wave": _int64, "priority": _int64, "resumable": _bool,
    "external_req_id": _or_nil(_str), "reasoning_ended": _or_nil(_bool),
    "abort_immediately": _bool, "session_id": _or_nil(_str),
}


@pytest.mark.parametrize(("m", "index"), _request_cases(),
                         ids=[f"{m.name[:3]}[{i}]" for m, i in _request_cases()])
def test_wrong_type_in_every_request_field(m: Message, index: int) -> None:
    is_add = m.frames[1] == b"\x00"
    kind = {b"\x00": "ADD", b"\x01": "ABORT", b"\x03": "UTILITY"}[m.frames[1]]
    for wrong in _WRONG:
        payload = plain_unpack(m.frames[2])
        payload[index] = wrong
        refused = _refusal(decode_request, [m.frames[1], _pack(payload)])
        if refused is not None:  # a refusal says where: the field, or the message's layout
            named = REQUEST_FIELDS[index] if is_add else f"{kind} request"
            assert named in refused or "extension type" in refused, refused
        field = REQUEST_FIELDS[index] if is_add else None
        if field in _ADD_SCALARS:
            assert (refused is None) == _ADD_SCALARS[field](wrong), (field, wrong, refused)
        elif kind == "ABORT":  # a list of request-id strings
            assert (refused is None) == _str(wrong), (wrong, refused)
        sampling = plain_unpack(m.frames[2])
        if is_add and isinstance(sampling[3], dict):
            for key in list(sampling[3]):
                mutated = dict(sampling[3])
                mutated[key] = wrong
                refused = _refusal(decode_request, [
                    m.frames[1], _pack([*sampling[:3], mutated, *sampling[4:]])])
                if refused is not None:
                    assert f"sampling_params.{key}" in refused \
                        or "extension type" in refused, refused


def _handshake_cases() -> list[tuple[Message, str]]:
    cases = []
    for prefix in ("h1", "h2", "h4"):
        m = find(".", prefix)
        cases += [(m, key) for key in plain_unpack(m.frames[1])]
    return cases


_HANDSHAKE_DECODERS: dict[str, Callable[[bytes], object]] = {
    "h1": decode_status, "h2": decode_init, "h4": decode_ready_response}


@pytest.mark.parametrize(("m", "key"), _handshake_cases(),
                         ids=[f"{m.name[:2]}.{k}" for m, k in _handshake_cases()])
def test_wrong_type_in_every_handshake_field(m: Message, key: str) -> None:
    decode = _HANDSHAKE_DECODERS[m.name[:2]]
    golden = decode(m.frames[1])

    def check(value: dict[str, Any], what: str) -> None:
        try:
            decoded = decode(_pack(value))
        except (ProtocolError, HandshakeError) as exc:  # refused: the error says where
            assert key in str(exc) or "extension type" in str(exc) \
                or "HELLO or READY" in str(exc), (what, str(exc))
            return
        # Accepted: a field the decoder keeps has the golden value's type (the others are
        # fields this client ignores, which may hold anything).
        if hasattr(golden, key) and getattr(decoded, key) is not None \
                and getattr(golden, key) is not None:
            assert type(getattr(decoded, key)) is type(getattr(golden, key)), (what, decoded)

    for wrong in _WRONG:
        value = plain_unpack(m.frames[1])
        value[key] = wrong
        check(value, f"{key}={wrong!r:.40}")
        if isinstance(value.get("addresses"), dict):
            continue
        value = plain_unpack(m.frames[1])
        if key == "addresses":
            for sub in list(value[key]):
                value = plain_unpack(m.frames[1])
                value[key][sub] = wrong
                check(value, f"addresses.{sub}={wrong!r:.40}")
    value = plain_unpack(m.frames[1])
    del value[key]
    check(value, f"without {key}")


# ------------------------------------------------------------------- explicit errors


def _j(name: str) -> Message:
    return find(EOS, name)


def _with(m: Message, path: tuple[Any, ...], value: Any,
          frames: list[bytes] | None = None) -> list[bytes]:
    frames = list(m.frames if frames is None else frames)
    tree = plain_unpack(frames[0])
    _get(tree, path[:-1])[path[-1]] = value
    frames[0] = _pack(tree)
    return frames


def _first_logprobs_message() -> Message:
    return next(m for m in _ARRAYS if plain_unpack(m.frames[0])[1][0][2] is not None)


def _prompt_logprobs_message() -> Message:
    return next(m for m in _ARRAYS if plain_unpack(m.frames[0])[1][0][3] is not None)


@pytest.mark.parametrize(("path", "value", "match"), [
    ((1, 0, 5), 9, r"EngineCoreOutput\(req-A\)\.finish_reason: unknown value int 9"),
    ((1, 0, 1), [-1], r"EngineCoreOutput\(req-A\)\.new_token_ids\[0\]: expected a "
                      r"non-negative int, got int -1"),
    ((1, 0, 1), [True], r"EngineCoreOutput\(req-A\)\.new_token_ids\[0\]"),
    ((1, 0, 0), 7, r"EngineCoreOutput\[0\]\.request_id: expected str, got int 7"),
    ((1, 0, 6), 1.5, r"EngineCoreOutput\(req-A\)\.stop_reason: expected int, str or nil"),
    ((1, 0, 7), [{"type": 9, "timestamp": 1.0}],
     r"EngineCoreOutput\(req-A\)\.events\[0\]\.type: unknown event type int 9"),
    ((1, 0, 7), [{"type": True, "timestamp": 1.0}], r"events\[0\]\.type"),
    ((1, 0, 7), [{"type": [1], "timestamp": 1.0}], r"events\[0\]\.type"),
    ((1, 0, 7), [{"type": 1, "timestamp": "now"}], r"events\[0\]\.timestamp"),
    ((1, 0, 10), {"traceparent": 5}, r"EngineCoreOutput\(req-A\)\.trace_headers"),
    ((1, 0, 11, "num_prompt_tokens"), "5",
     r"EngineCoreOutput\(req-A\)\.prefill_stats\.num_prompt_tokens: expected int"),
    ((1, 0, 13), None, None),  # nil NaN count: accepted as 0
    ((1, 0, 13), 1.0, r"EngineCoreOutput\(req-A\)\.num_nans_in_logits: expected int"),
    ((1, 0), "req-A", r"EngineCoreOutput\[0\]: expected an array of at least 2 fields"),
    ((1,), {}, r"EngineCoreOutputs\.outputs: expected an array"),
    ((0,), "0", r"EngineCoreOutputs\.engine_index: expected int"),
    ((3,), "now", r"EngineCoreOutputs\.timestamp: expected a number"),
    ((5,), ["req-A", 1], r"EngineCoreOutputs\.finished_requests: expected an array of str"),
    ((2, "num_running_reqs"), "1",
     r"EngineCoreOutputs\.scheduler_stats\.num_running_reqs: expected int"),
    ((2, "prefix_cache_stats"), [], r"EngineCoreOutputs\.scheduler_stats\.prefix_cache_stats"),
    ((1, 0, 2), msgpack.ExtType(1, b"\x80\x04N."), r"pickle extension type 1 refused"),
    ((1, 0, 2), msgpack.ExtType(9, b""), r"unknown msgpack extension type 9"),
])
def test_error_names_the_struct_and_field(path: tuple[Any, ...], value: Any,
                                          match: str | None) -> None:
    frames = _with(find(".", "e001"), path, value)
    if match is None:
        decode_outputs(frames)
        return
    with pytest.raises(ProtocolError, match=match):
        decode_outputs(frames)


def test_utility_errors_name_the_field() -> None:
    m = find(".", "e023_output_utility")
    with pytest.raises(ProtocolError, match=r"utility_output\.result: typed \(pickled\) "
                                            r"results are refused"):
        decode_outputs(_with(m, (4, 2, 0), "builtins.list"))
    with pytest.raises(ProtocolError, match=r"utility_output\.call_id: expected int"):
        decode_outputs(_with(m, (4, 0), "1"))
    with pytest.raises(ProtocolError, match=r"a utility reply must not carry outputs"):
        decode_outputs(_with(m, (1,), [["req-A", [1]]]))


_LP = "EngineCoreOutput\\(J4\\)\\.new_logprobs"
_PLP = "EngineCoreOutput\\(J5\\)\\.new_prompt_logprobs_tensors"


@pytest.mark.parametrize(("field", "index", "value", "match"), [
    (3, (0, 2), 7, _PLP + r"\.token_ids\.data: aux frame index 7 out of range "
                          r"\(message has 3 frames\)"),
    (3, (0, 2), 0, _PLP + r"\.token_ids\.data: aux frame index 0 out of range"),
    (3, (0, 2), -1, r"aux frame index -1 out of range"),
    (3, (1, 1), [40, 5], _PLP + r"\.logprobs: float32 shape .* needs 800 bytes, the data has 960"),
    (3, (0, 1), [41, 6], _PLP + r"\.token_ids: int32 shape .* needs 984 bytes, the data has 960"),
    (3, (0, 1), [2**40 - 1, 2**40 - 1], _PLP + r"\.token_ids\.shape: .* is too large"),
    (3, (0, 1), [2**19, 2**19], r"needs 1099511627776 bytes, the data has 960"),
    (3, (2, 2), 2, _PLP + r"\.ranks: int32 shape .* needs 160 bytes, the data has 960"),
    (3, (0, 1), [0, 2**40 - 1, 2**40 - 1], _PLP + r"\.token_ids\.shape: .* is too large"),
    (3, (0, 1), [1] * 65, _PLP + r"\.token_ids\.shape: expected a list of at most 32 sizes"),
    (3, (0, 1), [-40, 6], _PLP + r"\.token_ids\.shape"),
    (3, (0, 0), "<U4", _PLP + r"\.token_ids\.dtype: unsupported dtype str '<U4'"),
    (3, (0, 0), "<(2)i4", r"unsupported dtype"),
    (3, (0, 0), "float32", _PLP + r": token ids and ranks must be integers, logprobs floats"),
    (3, (3,), [0, 40], _PLP + r"\.cu_num_generated_tokens: must be nil"),
    (3, (2, 2), msgpack.ExtType(2, b""), r"pickle extension type 2 refused"),
    (3, (2, 2), 3, _PLP + r"\.ranks\.data: aux frame index 3 out of range"),
    (3, (2, 1), [4, 10], _PLP + r": inconsistent shapes token_ids \(40, 6\), logprobs "
                         r"\(40, 6\), ranks \(4, 10\)"),
])
def test_prompt_logprobs_errors(field: int, index: tuple[int, ...], value: Any,
                                match: str) -> None:
    m = _prompt_logprobs_message()
    with pytest.raises(ProtocolError, match=match):
        decode_outputs(_with(m, (1, 0, field, *index), value))


def _logprobs_triple(ids: np.ndarray[Any, Any], lps: np.ndarray[Any, Any],
                     ranks: np.ndarray[Any, Any]) -> list[Any]:
    def arr(a: np.ndarray[Any, Any]) -> list[Any]:
        return [a.dtype.str, list(a.shape), msgpack.ExtType(3, a.tobytes())]
    return [arr(ids), arr(lps), arr(ranks), None]


@pytest.mark.parametrize(("ids", "lps", "ranks", "match"), [
    (np.zeros((1, 0), "<i4"), np.zeros((1, 0), "<f4"), np.ones(1, "<i8"),
     _LP + r": 1 positions with zero columns"),
    (np.array([[-5, 1]], "<i4"), np.zeros((1, 2), "<f4"), np.ones(1, "<i8"),
     _LP + r"\.token_ids: negative token id"),
    (np.array([[5, 5]], "<i4"), np.zeros((1, 2), "<f4"), np.zeros(1, "<i8"),
     _LP + r"\.ranks: a sampled token's rank must be at least 1"),
    (np.array([[5, 5]], "<i4"), np.zeros((1, 2), "<f4"), np.full(1, -3, "<i8"),
     r"rank must be at least 1"),
    (np.array([5, 5], "<i4"), np.zeros(2, "<f4"), np.ones(1, "<i8"), _LP + r": inconsistent"),
    (np.array([[5, 5]], "<i4"), np.zeros((1, 2), "<c8"), np.ones(1, "<i8"),
     r"logprobs floats"),
])
def test_sample_logprobs_errors(ids: np.ndarray[Any, Any], lps: np.ndarray[Any, Any],
                                ranks: np.ndarray[Any, Any], match: str) -> None:
    m = _first_logprobs_message()
    with pytest.raises(ProtocolError, match=match):
        decode_outputs(_with(m, (1, 0, 2), _logprobs_triple(ids, lps, ranks)))


def _mask_message(offsets: list[int] | None, ids: list[int], tokens: int) -> list[bytes]:
    message = EngineCoreOutputs(outputs=[EngineCoreOutput(
        "m", list(range(tokens)),
        new_sampling_mask=SamplingMask(np.array(ids, "<i4"),
                                       None if offsets is None else np.array(offsets, "<i8")),
    )])
    return [bytes(f) for f in encode_outputs(message, fields=19)]


def test_sampling_mask_roundtrip_and_csr_errors() -> None:
    decoded = decode_outputs(_mask_message([0, 2, 3], [4, 5, 6], 2))
    mask = decoded.message.outputs[0].new_sampling_mask  # type: ignore[union-attr]
    assert mask is not None and mask.rows == [[4, 5], [6]]
    where = r"EngineCoreOutput\(m\)\.new_sampling_mask"
    for offsets in ([0, 3, 2], [1, 2, 3], [0, 2, 4], [0, 3, -1, 3]):
        frames = _mask_message([0, 2, 3], [4, 5, 6], 2)
        tree = plain_unpack(frames[0])
        tree[1][0][15][1] = ["<i8", [len(offsets)],
                             msgpack.ExtType(3, np.array(offsets, "<i8").tobytes())]
        with pytest.raises(ProtocolError, match=where + r"\.offsets: must start at 0, never "
                                                        r"decrease and end at 3"):
            decode_outputs([_pack(tree)])
    # A row count that differs from the new tokens decodes: it fails that request only, in
    # the generate layer (tests/generate), not the whole message.
    odd = decode_outputs(_mask_message([0, 2, 3], [4, 5, 6], 3))
    assert odd.message.outputs[0].new_sampling_mask.rows == [[4, 5], [6]]  # type: ignore[union-attr]
    frames = _mask_message(None, [4, 5], 1)
    tree = plain_unpack(frames[0])
    tree[1][0][15][0][1] = [1, 2]
    with pytest.raises(ProtocolError, match=where + r"\.token_ids: "):
        decode_outputs([_pack(tree)])


@pytest.mark.parametrize(("payload", "kind", "match"), [
    (["r", ["x"], None, {}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.prompt_token_ids: expected a list of int"),
    (["r", [1], None, {}, None], b"\x00", r"EngineCoreRequest: expected an array of at least 9"),
    ([b"r", [1], None, {}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.request_id: expected str, got bytes"),
    (["r", [1], None, {"temperature": "hot"}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.temperature: expected float, got str 'hot'"),
    (["r", [1], None, {"top_k": True}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.top_k: expected int, got bool"),
    (["r", [1], None, {"logit_bias": {"5": 1.0}}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.logit_bias: expected \{int: float\}"),
    (["r", [1], None, {"n": 0}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.n: must be in \[1, 16384\]"),
    (["r", [1], None, {"n": 2, "temperature": 0.0}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.n: must be 1 when using greedy sampling"),
    (["r", [1], None, {"temperature": -1.0}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.temperature: must be in \[0, 2\]"),
    (["r", [1], None, {"min_tokens": 17}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.min_tokens: must be in \[0, max_tokens=16\]"),
    (["r", [1], None, {"stop": ["x", ""]}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.stop: cannot contain an empty string"),
    (["r", [1], None, None, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params: expected a map, got nil"),
    (["r", [1], None, {"output_kind": 7}, None, 0.0, None, None, None], b"\x00",
     r"EngineCoreRequest\.sampling_params\.output_kind: expected 0, 1 or 2"),
    (["r", [1], None, {}, None, "now", None, None, None], b"\x00",
     r"EngineCoreRequest\.arrival_time: expected a number"),
    (["r", [1], None, {}, None, 0.0, None, None, None, None, None, 0, 0, 0, {"a": 1}], b"\x00",
     r"EngineCoreRequest\.trace_headers: expected \{str: str\} or nil"),
    (["r", [1], None, {}, None, 0.0, None, None, None, None, None, 0, 0, 0, None, None],
     b"\x00", r"EngineCoreRequest\.resumable: expected bool, got NoneType"),
    (["r", [1], None, {}, None, 0.0, ["lora", "1"], None, None], b"\x00",
     r"EngineCoreRequest\.lora_request\.lora_int_id: expected int, got str"),
    (["r", [1], None, {}, None, 0.0, ["lora", True, "/p"], None, None], b"\x00",
     r"EngineCoreRequest\.lora_request\.lora_int_id: expected int, got bool"),
    (["r", [1], None, {}, None, 0.0, ["lora", 1, None], None, None], b"\x00",
     r"EngineCoreRequest\.lora_request\.lora_path: expected str, got NoneType"),
    (["r", [1], None, {}, None, 0.0, ["lora", 1], None, None], b"\x00",
     r"EngineCoreRequest\.lora_request\.lora_path: AssertionError"),
    (["r", [1], None, {}, None, 0.0, ["lora", 0, "/p"], None, None], b"\x00",
     r"EngineCoreRequest\.lora_request\.lora_int_id: id must be > 0"),
    (["r", [1], None, {}, None, 0.0, ["lora"], None, None], b"\x00",
     r"EngineCoreRequest\.lora_request: expected an array of at least 2 fields"),
    ([0, 1, "m"], b"\x03", r"UTILITY request: expected \[client_index, call_id, method, args\]"),
    (["a", 1], b"\x01", r"ABORT request: expected a list of request id strings"),
    ([0, None], b"\x02", r"START_DP_WAVE is only sent by a data-parallel coordinator"),
    ([], b"\x07", r"request: unknown request type b'\\x07'"),
])
def test_request_errors_name_the_field(payload: Any, kind: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_request([kind, _pack(payload)])


def test_request_error_for_a_missing_frame() -> None:
    with pytest.raises(ProtocolError, match=r"request: expected \[type, payload\], got 1"):
        decode_request([b"\x00"])


def test_handshake_errors_name_the_field() -> None:
    h4 = plain_unpack(find(".", "h4").frames[1])
    for key in ("max_model_len", "vllm_version", "data_parallel_rank"):
        broken = dict(h4)
        del broken[key]
        with pytest.raises(ProtocolError, match=rf"EngineCoreReadyResponse\.{key}: missing"):
            decode_ready_response(_pack(broken))
    with pytest.raises(ProtocolError,
                       match=r"EngineCoreReadyResponse\.supports_lora: expected bool, got int"):
        decode_ready_response(_pack({**h4, "supports_lora": 1}))
    with pytest.raises(ProtocolError,
                       match=r"EngineCoreReadyResponse\.max_model_len: expected int, got str"):
        decode_ready_response(_pack({**h4, "max_model_len": "512"}))
    with pytest.raises(ProtocolError, match=r"EngineCoreReadyResponse: expected a map"):
        decode_ready_response(_pack([h4]))
    h2 = plain_unpack(find(".", "h2").frames[1])
    with pytest.raises(HandshakeError, match=r"INIT\.addresses\.inputs: expected a non-empty"):
        decode_init(_pack({**h2, "addresses": {**h2["addresses"], "inputs": []}}))
    with pytest.raises(HandshakeError, match=r"INIT\.addresses\.coordinator_input"):
        decode_init(_pack({**h2, "addresses": {**h2["addresses"], "coordinator_input": 5}}))
    with pytest.raises(HandshakeError, match=r"INIT: expected a map with an addresses map"):
        decode_init(_pack({"addresses": None}))
    with pytest.raises(HandshakeError, match=r"handshake message: expected a HELLO or READY"):
        decode_status(_pack({"status": "HI"}))
    with pytest.raises(HandshakeError, match=r"handshake message\.local: expected a bool"):
        decode_status(_pack({"status": "HELLO", "local": "no"}))
    with pytest.raises(HandshakeError, match=r"handshake message: not valid msgpack"):
        decode_status(b"\xc1")


def test_messages_about_huge_or_deep_values_stay_short() -> None:
    for value in (_deep(1000), list(range(100_000)), "x" * 1_000_000, b"y" * 1_000_000):
        frames = _with(find(".", "e001"), (1, 0), value)
        with pytest.raises(ProtocolError) as caught:
            decode_outputs(frames)
        assert len(str(caught.value)) < 300
    with pytest.raises(ProtocolError) as caught:
        decode_array(["<i4", list(range(40)), 1], [b""], "x")
    assert len(str(caught.value)) < 300


def test_deep_nesting_beyond_the_msgpack_stack() -> None:
    for depth in (1023, 1024, 1025, 5000):
        data = b"\x91" * depth + b"\xc0"
        _any_decoder([data])
        with pytest.raises(ProtocolError):
            decode_outputs([b"\x99\x00" + data])


# ------------------------------------------------------------------- SamplingParams.validate


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": 3.0}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"logprobs": -2}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"logprobs": -1}, "logprobs"),  # the whole vocabulary (1024) > max_logprobs (20)
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"eos_token_id": 1024}, "eos_token_id"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"stop_token_ids": [5, 1024]}, "stop_token_ids[1]"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"stop_token_sequences": [[1, 2], []]}, "stop_token_sequences[1]"),
    ({"stop_token_sequences": [[1, 5000]]}, "stop_token_sequences[0][1]"),
    ({"bad_words_token_ids": [[3], [-4]]}, "bad_words_token_ids[1][0]"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids[0]"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 2048]}, "allowed_token_ids[1]"),
    ({"logit_bias": {2048: 1.0}}, "logit_bias[2048]"),
    ({"logit_bias": {5: math.nan}}, "logit_bias[5]"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias['5']"),
    ({"skip_reading_prefix_cache": "yes"}, "skip_reading_prefix_cache"),
    ({"extra_args": {"big": 2**70}}, "extra_args['big']"),
    ({"extra_args": {"deep": _deep(40)}}, "extra_args['deep']" + "[0]" * 32),
    ({"extra_args": {1: "x"}}, "extra_args"),
    ({"extra_args": {"obj": object()}}, "extra_args['obj']"),
])
def test_sampling_params_validate_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    params = SamplingParams(**kwargs)
    with pytest.raises(InvalidRequestError) as caught:
        params.validate(vocab_size=1024, max_logprobs=20)
    assert caught.value.field == field
    assert f"invalid request: {field}: " in str(caught.value)
    assert isinstance(caught.value, ValueError)  # InvalidRequestError is also a ValueError


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0.0}, {"temperature": 2.0}, {"top_p": 1.0, "top_k": -1},
    {"min_tokens": 8, "max_tokens": 8}, {"logprobs": 20, "prompt_logprobs": 0},
    {"seed": -1}, {"seed": 2**64 - 1}, {"stop_token_ids": [0, 1023]}, {"eos_token_id": 1023},
    {"logit_bias": {5: -100.0}}, {"extra_args": {"k": [1, {"x": None}]}},
])
def test_sampling_params_validate_accepts_the_limits(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs).validate(vocab_size=1024, max_logprobs=20)


def test_logprobs_without_max_logprobs_is_unbounded() -> None:
    SamplingParams(logprobs=10_000).validate()
    lp = Logprobs(np.zeros((1, 2), "<i4"), np.zeros((1, 2), "<f4"), np.ones(1, "<i8"))
    assert len(lp) == 1
