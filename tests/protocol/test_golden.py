"""Golden frames from a real vLLM 0.32.0 engine decode to what the capture's manifests say.

Every expected value below is read from the capture (run-results.json: per-request results and
the log's schema-less decode of each message; the request frames themselves), never from a
decode of ours.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from typing import Any

import attrs
import msgpack
import numpy as np
import pytest

from anyio_genout import InvalidRequestError, ProtocolError
from anyio_genout.protocol import (
    ENGINE_CORE_DEAD,
    AbortRequest,
    AddRequest,
    EngineCoreEventType,
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineStatus,
    HandshakeAddresses,
    RequestBatch,
    SamplingParams,
    UtilityReply,
    UtilityRequest,
    check_version,
    decode_init,
    decode_outputs,
    decode_ready_response,
    decode_request,
    decode_status,
    encode_abort,
    encode_add,
    encode_init,
    encode_utility,
    engine_identity,
    identity_rank,
)

from ._golden import (
    FOLDERS,
    MAIN,
    Message,
    find,
    log_order,
    messages,
    plain_unpack,
    run_results,
    typed,
)

EOS_VARIANT = "variant-eos-stop-logprobs"
SIGTERM_VARIANT = "variant-sigterm-inflight-enginecore"
DUP_VARIANT = "variant-duplicate-request-id"
OOV_VARIANT = "variant-disable-log-stats-oov"
#: Folders of the scripted run (requests A..G2), whose logs hold a plain decode of each output.
SCRIPTED = (MAIN, OOV_VARIANT, DUP_VARIANT)


def _decode(m: Message) -> Any:
    return decode_outputs(m.frames)


def _message(m: Message) -> EngineCoreOutputs:
    decoded = _decode(m)
    assert isinstance(decoded, RequestBatch | UtilityReply)
    return decoded.message


def _outputs(folder: str) -> list[tuple[Message, EngineCoreOutputs]]:
    """Every engine-output message of ``folder`` that is not ENGINE_CORE_DEAD, decoded."""
    return [(m, _message(m)) for m in messages("e", (folder,)) if "ENGINE_CORE_DEAD" not in m.name]


def _rows(folder: str) -> dict[str, list[tuple[Message, EngineCoreOutput]]]:
    rows: dict[str, list[tuple[Message, EngineCoreOutput]]] = defaultdict(list)
    for m, message in _outputs(folder):
        for output in message.outputs:
            rows[output.request_id].append((m, output))
    return rows


def _request_id(folder: str, key: str) -> str:
    """The request id behind a run-results key: ``A`` is ``req-A``, ``J1_eos`` is ``J1``."""
    candidates = {f"req-{key}", key.split("_")[0]}
    adds = {plain_unpack(m.frames[2])[0] for m in messages("c", (folder,))
            if m.frames[1] == b"\x00"}
    (rid,) = candidates & adds
    return str(rid)


# ------------------------------------------------------------------- engine outputs


def _with_plain_decode() -> list[Message]:
    return [m for m in messages("e") if m.log.startswith("decoded(plain)=")]


def _assert_output(output: EngineCoreOutput, row: list[Any]) -> None:
    row = row + [None] * (19 - len(row))
    assert type(output) is EngineCoreOutput
    assert output.request_id == row[0]
    assert output.new_token_ids == row[1]
    assert all(type(t) is int for t in output.new_token_ids)
    assert output.new_logprobs is None and row[2] is None
    assert output.new_prompt_logprobs is None and row[3] is None
    assert output.pooling_output is None and row[4] is None
    if row[5] is None:
        assert output.finish_reason is None
    else:
        assert output.finish_reason is EngineCoreFinishReason(row[5])
        assert output.finished
    assert output.stop_reason == row[6]
    if row[7] is None:
        assert output.events is None
    else:
        assert output.events is not None
        assert [(e.type, e.timestamp) for e in output.events] == [
            (EngineCoreEventType(e["type"]), e["timestamp"]) for e in row[7]
        ]
        assert all(type(e.type) is EngineCoreEventType for e in output.events)
    assert output.kv_transfer_params == row[8]
    assert output.ec_transfer_params == row[9]
    assert output.trace_headers == row[10]
    if row[11] is None:
        assert output.prefill_stats is None
    else:
        assert output.prefill_stats is not None
        assert attrs.asdict(output.prefill_stats) == row[11]
    assert output.routed_experts is None and row[12] is None
    assert output.num_nans_in_logits == row[13]
    assert output.mm_cache_miss_hashes == row[14]
    assert output.new_sampling_mask is None and row[15] is None
    assert output.spec_decode_metrics == row[16]
    assert output.prompt_token_id_logprobs is None and row[17] is None
    assert output.error is None and row[18] is None


@pytest.mark.parametrize("m", _with_plain_decode(), ids=str)
def test_output_message_decodes_to_the_manifest(m: Message) -> None:
    plain = m.plain
    assert len(plain) == 9
    engine_index, rows, stats, timestamp, util, finished, wave_complete, start_wave, wv = plain
    decoded = _decode(m)
    assert isinstance(decoded, UtilityReply if util is not None else RequestBatch)
    message = decoded.message
    assert message.engine_index == engine_index
    assert message.timestamp == timestamp
    assert message.finished_requests == (None if finished is None else frozenset(finished))
    assert message.wave_complete == wave_complete
    assert message.start_wave == start_wave
    assert message.weight_version == wv
    assert len(message.outputs) == len(rows)
    for output, row in zip(message.outputs, rows, strict=True):
        _assert_output(output, row)
    if stats is None:
        assert message.scheduler_stats is None
    else:
        s = message.scheduler_stats
        assert s is not None
        assert (s.num_running_reqs, s.num_waiting_reqs, s.num_skipped_waiting_reqs,
                s.step_counter, s.current_wave) == (
            stats["num_running_reqs"], stats["num_waiting_reqs"],
            stats["num_skipped_waiting_reqs"], stats["step_counter"], stats["current_wave"])
        assert s.kv_cache_usage == stats["kv_cache_usage"]
        assert s.prefix_cache_queries == stats["prefix_cache_stats"]["queries"]
        assert s.prefix_cache_hits == stats["prefix_cache_stats"]["hits"]
        assert s.raw == stats
    if util is None:
        assert message.utility_output is None
    else:
        call_id, failure, result = util
        reply = message.utility_output
        assert reply is not None
        assert (reply.call_id, reply.failure_message) == (call_id, failure)
        assert reply.has_result is (result is not None)
        assert reply.result == (None if result is None else result[1])


def test_every_scripted_output_has_a_plain_decode_in_the_manifest() -> None:
    # Guards the parametrization above against silently shrinking.
    for folder in (*SCRIPTED, SIGTERM_VARIANT):
        outputs = [m for m in messages("e", (folder,)) if "ENGINE_CORE_DEAD" not in m.name]
        assert outputs
        assert all(m.log.startswith("decoded(plain)=") for m in outputs)


@pytest.mark.parametrize("m", messages("e", (EOS_VARIANT,)), ids=str)
def test_logprobs_variant_frame_counts_match_the_manifest(m: Message) -> None:
    # This variant's log only records the frame count (n_frames=N).
    assert m.log == f"n_frames={len(m.frames)}"
    message = _message(m)
    assert message.scheduler_stats is not None


@pytest.mark.parametrize("m", [m for m in messages("e") if "ENGINE_CORE_DEAD" in m.name], ids=str)
def test_engine_core_dead(m: Message) -> None:
    assert m.log.startswith("raw bytes b'ENGINE_CORE_DEAD'")
    assert m.frames == [ENGINE_CORE_DEAD]
    assert isinstance(decode_outputs(m.frames), EngineDead)
    assert log_order(m.folder)[-1] == m.name  # nothing follows an engine's death


def test_engine_core_dead_files_exist_where_the_engine_died() -> None:
    dead = {m.folder for m in messages("e") if "ENGINE_CORE_DEAD" in m.name}
    assert dead == {OOV_VARIANT, DUP_VARIANT}
    assert run_results(OOV_VARIANT)["results"]["I_oov"] == "ENGINE_CORE_DEAD received"


# ------------------------------------------------------------------- per-request results


def _token_results() -> list[tuple[str, str]]:
    return [(folder, key) for folder in FOLDERS
            for key, value in run_results(folder)["results"].items()
            if isinstance(value, dict) and isinstance(value.get("tokens"), list)]


@pytest.mark.parametrize(("folder", "key"), _token_results(),
                         ids=[f"{f}:{k}" for f, k in _token_results()])
def test_token_sequence_and_finish_per_request(folder: str, key: str) -> None:
    expected = run_results(folder)["results"][key]
    rid = _request_id(folder, key)
    rows = _rows(folder)[rid]
    assert [t for _, o in rows for t in o.new_token_ids] == expected["tokens"]
    # Exactly one output finishes the request: the last one.
    assert [o.finished for _, o in rows] == [False] * (len(rows) - 1) + [True]
    last = rows[-1][1]
    assert last.finish_reason == expected["finish_reason"]
    assert last.stop_reason == expected["stop_reason"]
    if "finished_requests" in expected:
        seen = {r for m, _ in rows for r in (_message(m).finished_requests or ())}
        assert sorted(seen & {rid}) == expected["finished_requests"]
    if "frames" in expected:
        assert sorted({len(m.frames) for m, _ in rows}) == expected["frames"]


def test_token_results_cover_every_folder_with_requests() -> None:
    assert {f for f, _ in _token_results()} == {MAIN, OOV_VARIANT, DUP_VARIANT, EOS_VARIANT}
    assert len(_token_results()) >= 4 * 3 + 7


@pytest.mark.parametrize("folder", SCRIPTED)
def test_client_abort_gets_no_final_output(folder: str) -> None:
    expected = run_results(folder)["results"]["D"]
    rows = _rows(folder)["req-D"]
    tokens = [t for _, o in rows for t in o.new_token_ids]
    assert len(tokens) == expected["tokens_before_abort"] == expected["total_tokens"]
    assert not any(o.finished for _, o in rows)
    order = log_order(folder)
    abort = order.index(find(folder, "c10_ABORT").name)
    assert all(order.index(m.name) < abort for m, _ in rows)


@pytest.mark.parametrize("folder", SCRIPTED)
def test_abort_of_an_unknown_id_gets_only_stats(folder: str) -> None:
    note = run_results(folder)["results"]["F"]
    prefix = "outputs after ABORT of unknown id: "
    assert note.startswith(prefix)
    expected = ast.literal_eval(note[len(prefix):])
    order = log_order(folder)
    start = order.index(find(folder, "c12_ABORT").name)
    after = []
    for name in order[start + 1:]:
        if name.startswith("c"):
            break
        message = _message(Message(folder, name))
        after.append((message.engine_index, list(message.outputs)))
    assert after == expected


@pytest.mark.parametrize("folder", SCRIPTED)
def test_utility_results_and_failure_text(folder: str) -> None:
    results = run_results(folder)["results"]
    replies = {}
    for _, message in _outputs(folder):
        if message.utility_output is not None:
            replies[message.utility_output.call_id] = message.utility_output
    ok, failed = results["C"], results["C2"]
    assert set(replies) == {ok["call_id"], failed["call_id"]}
    good = replies[ok["call_id"]]
    assert good.failure_message is ok["failure"] is None
    assert good.has_result
    assert good.result == ast.literal_eval(ok["result"])
    bad = replies[failed["call_id"]]
    assert bad.failure_message == failed["failure"]
    assert not bad.has_result
    # The calls that asked for them:
    assert plain_unpack(find(folder, "c07_UTILITY").frames[2])[1] == ok["call_id"]
    assert plain_unpack(find(folder, "c08_UTILITY").frames[2])[1] == failed["call_id"]


def test_sigterm_variant_ends_the_request_with_abort_and_finished_requests() -> None:
    seen = run_results(SIGTERM_VARIANT)["results"]["K_sigterm_inflight"]["seen"]
    decoded = []
    for _, message in _outputs(SIGTERM_VARIANT):
        for output in message.outputs:
            if output.finish_reason is not None:
                decoded.append([output.request_id, int(output.finish_reason),
                                sorted(message.finished_requests or ())])
    assert decoded == seen
    (m,) = messages("e", (SIGTERM_VARIANT,))
    message = _message(m)
    (output,) = message.outputs
    assert output.finish_reason is EngineCoreFinishReason.ABORT
    assert output.new_token_ids == []
    assert message.finished_requests == frozenset({output.request_id})


@pytest.mark.parametrize("folder", [MAIN, DUP_VARIANT])
def test_duplicate_request_id_outputs_then_death(folder: str) -> None:
    expected = run_results(folder)["results"]["G3_duplicate_id"]
    raw: list[list[Any]] = []
    for m in messages("e", (folder,)):
        decoded = _decode(m)
        if isinstance(decoded, EngineDead):
            raw.append(["ENGINE_CORE_DEAD", 0, None])
            continue
        for o in decoded.message.outputs:
            if o.request_id == "dup":
                raw.append(["dup", len(o.new_token_ids), o.finish_reason])
    assert raw == expected["raw"]
    assert len(raw) == expected["n_outputs"]
    assert sum(n for rid, n, _ in raw if rid == "dup") == expected["tokens"]


@pytest.mark.parametrize("folder", SCRIPTED)
def test_first_output_carries_events_and_prefill_stats(folder: str) -> None:
    prompts = {}
    for m in messages("c", (folder,)):
        payload = plain_unpack(m.frames[2])
        if m.frames[1] == b"\x00" and type(payload[1]) is list:
            prompts[payload[0]] = payload[1]
    with_stats = folder != OOV_VARIANT  # --disable-log-stats: no events, no scheduler stats
    checked = 0
    for rid, rows in _rows(folder).items():
        first = rows[0][1]
        assert first.prefill_stats is not None
        if rid in prompts:  # (the duplicate-id test's ADDs were not saved)
            assert first.prefill_stats.num_prompt_tokens == len(prompts[rid])
        assert first.prefill_stats.num_computed_tokens == first.prefill_stats.num_prompt_tokens
        assert all(o.prefill_stats is None and o.events is None for _, o in rows[1:])
        if with_stats:
            assert first.events is not None
            queued, scheduled = first.events
            assert queued.type is EngineCoreEventType.QUEUED
            assert scheduled.type is EngineCoreEventType.SCHEDULED
            assert 0 < queued.timestamp <= scheduled.timestamp
            assert rows[0][0].log.count("'type': 1") == 1  # the manifest agrees
        else:
            assert first.events is None
        checked += 1
    assert checked >= 4
    assert all((message.scheduler_stats is not None) is with_stats
               for _, message in _outputs(folder) if message.utility_output is None)


# ------------------------------------------------------------------- logprobs


def test_sample_logprobs_j4() -> None:
    expected = run_results(EOS_VARIANT)["results"]["J4_logprobs"]
    rows = [o for _, o in _rows(EOS_VARIANT)["J4"]]
    with_logprobs = [o for o in rows if o.new_logprobs is not None]
    assert len(with_logprobs) == len(expected["logprobs"]) == len(expected["tokens"])
    for output, (ids, logprobs, ranks, cu) in zip(with_logprobs, expected["logprobs"],
                                                  strict=True):
        lp = output.new_logprobs
        assert lp is not None
        assert cu is None
        assert lp.token_ids.tolist() == ids
        assert lp.logprobs.dtype == np.float32
        assert lp.logprobs.tolist() == np.asarray(logprobs, dtype=np.float32).tolist()
        assert lp.ranks.tolist() == ranks
        assert len(lp) == len(output.new_token_ids)
        for i, position in enumerate(lp.positions):
            # Entry 0 is the sampled token with its true rank; entry j is the j-th best.
            assert position.sampled.token_id == output.new_token_ids[i]
            assert position.sampled.rank == ranks[i]
            assert [e.rank for e in position.entries[1:]] == list(range(1, len(ids[i])))
            assert [e.token_id for e in position] == ids[i]
    # The wire dtypes are vLLM's LogprobsLists numpy strings.
    m = next(m for m, o in _rows(EOS_VARIANT)["J4"] if o.new_logprobs is not None)
    wire = plain_unpack(m.frames[0])[1][0][2]
    assert [a[0] for a in wire[:3]] == ["<i4", "<f4", "<i8"]
    lp = with_logprobs[0].new_logprobs
    assert lp is not None
    assert (lp.token_ids.dtype.str, lp.logprobs.dtype.str, lp.ranks.dtype.str) == (
        "<i4", "<f4", "<i8")


def test_prompt_logprobs_j5_travel_in_aux_frames() -> None:
    expected = run_results(EOS_VARIANT)["results"]["J5_prompt_logprobs"]
    shapes = expected["prompt_logprobs"]
    rows = _rows(EOS_VARIANT)["J5"]
    carrying = [(m, o) for m, o in rows if o.new_prompt_logprobs is not None]
    assert len(carrying) == 1  # sent once, with the first sampled token
    m, output = carrying[0]
    assert len(m.frames) == max(expected["frames"]) == 3
    plp = output.new_prompt_logprobs
    assert plp is not None
    assert [list(plp.token_ids.shape), list(plp.logprobs.shape), list(plp.ranks.shape)] == \
        shapes[:3]
    assert shapes[3:] == [None, None]
    # Where the bytes went: the two big tensors are frames 1 and 2, the ranks are inline.
    wire = plain_unpack(m.frames[0])[1][0][3]
    assert [w[1] for w in wire[:3]] == shapes[:3]
    assert (wire[0][2], wire[1][2]) == (1, 2)
    assert isinstance(wire[2][2], msgpack.ExtType) and wire[2][2].code == 3
    assert wire[3:] == [None, None]
    assert plp.token_ids.tobytes() == m.frames[1]
    assert plp.logprobs.tobytes() == m.frames[2]
    assert plp.ranks.tobytes() == wire[2][2].data
    assert (plp.token_ids.dtype, plp.logprobs.dtype) == (np.int32, np.float32)
    # Entry 0 is the prompt token itself (positions 1.. of the prompt) with its true rank.
    add = find(EOS_VARIANT, "c24_ADD_J5")
    prompt = plain_unpack(add.frames[2])[1]
    k = plp.token_ids.shape[1] - 1
    assert k == plain_unpack(add.frames[2])[3]["prompt_logprobs"]
    assert plp.token_ids[:, 0].tolist() == prompt[1:]
    assert int(plp.ranks.min()) >= 1
    for i, position in enumerate(plp.positions):
        rank = int(plp.ranks[i])
        assert position.sampled == (prompt[i + 1], float(plp.logprobs[i, 0]), rank)
        assert [e.rank for e in position][1:] == list(range(1, k + 1))
        top = plp.logprobs[i, 1:]
        assert all(top[j] >= top[j + 1] for j in range(k - 1))
        if rank <= k:
            assert plp.token_ids[i, rank] == prompt[i + 1]
            assert plp.logprobs[i, rank] == plp.logprobs[i, 0]
        else:
            assert plp.logprobs[i, 0] <= plp.logprobs[i, k]
    assert output.new_token_ids == expected["tokens"][:1]
    assert output.new_logprobs is None


# ------------------------------------------------------------------- handshake


def _note_dict(m: Message) -> dict[str, Any]:
    note = m.log
    value = ast.literal_eval(note[note.index("{"):])
    assert isinstance(value, dict)
    return value


@pytest.mark.parametrize("m", messages("h1") + messages("h3"), ids=str)
def test_hello_and_ready(m: Message) -> None:
    expected = _note_dict(m)
    identity, payload = m.frames
    assert identity_rank(identity) == 0
    assert engine_identity(0) == identity
    status = decode_status(payload)
    assert status.status is EngineStatus(expected["status"])
    assert status.status is (EngineStatus.HELLO if m.name.startswith("h1") else EngineStatus.READY)
    assert (status.local, status.headless) == (expected["local"], expected["headless"])
    assert status.extra == {k: v for k, v in expected.items()
                            if k not in ("status", "local", "headless")}


@pytest.mark.parametrize("m", messages("h2"), ids=str)
def test_init_decodes_and_our_encoding_is_byte_identical(m: Message) -> None:
    assert "byte-identical to vLLM's own encoding" in m.log
    identity, payload = m.frames
    assert identity == engine_identity(0)
    plain = plain_unpack(payload)
    addresses = decode_init(payload)
    assert list(addresses.inputs) == plain["addresses"]["inputs"]
    assert list(addresses.outputs) == plain["addresses"]["outputs"]
    assert addresses.coordinator_input == plain["addresses"]["coordinator_input"]
    assert addresses.coordinator_output == plain["addresses"]["coordinator_output"]
    assert addresses.frontend_stats_publish_address == \
        plain["addresses"]["frontend_stats_publish_address"]
    assert dict(addresses.parallel_config) == plain["parallel_config"]
    ours = encode_init(HandshakeAddresses(inputs=plain["addresses"]["inputs"],
                                          outputs=plain["addresses"]["outputs"]))
    assert ours == payload


@pytest.mark.parametrize("m", messages("h4"), ids=str)
def test_ready_response(m: Message) -> None:
    expected = _note_dict(m)
    identity, payload = m.frames
    assert identity == engine_identity(0)
    response = decode_ready_response(payload)
    assert response.raw == expected
    for field in attrs.fields(type(response)):
        if field.name != "raw":
            assert getattr(response, field.name) == expected[field.name], field.name
    check_version(response.vllm_version)


# ------------------------------------------------------------------- requests

#: How the capture's front end built its vLLM-encoded ADDs (README + log notes), in our API.
_VLLM_ADDS: dict[str, SamplingParams] = {
    "c05": SamplingParams(temperature=0.0),
    "c06": SamplingParams(temperature=0.0, stop_token_ids=[990]),
    "c09": SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400),
}


def _vllm_adds() -> list[Message]:
    return [m for m in messages("c") if m.name[:3] in _VLLM_ADDS]


@pytest.mark.parametrize("m", _vllm_adds(), ids=str)
def test_our_add_has_the_value_tree_of_vllms(m: Message) -> None:
    identity, kind, payload = m.frames
    assert identity == engine_identity(0)
    theirs = plain_unpack(payload)
    assert payload[:3] == b"\xdc\x00\x16"  # msgspec's 22-field array: vLLM encoded this one
    request = EngineCoreRequest(
        request_id=theirs[0], prompt_token_ids=theirs[1], sampling_params=_VLLM_ADDS[m.name[:3]],
        arrival_time=theirs[5],
    )
    request.validate(vocab_size=1024, max_model_len=512)
    frames = encode_add(request)
    assert frames[0] == kind
    # Same values, same types (0.0 is not 0), same map key order.
    assert typed(plain_unpack(frames[1])) == typed(theirs)


def test_vllm_adds_found_in_every_scripted_folder() -> None:
    assert len(_vllm_adds()) == 3 * len(SCRIPTED)


@pytest.mark.parametrize("m", messages("c10") + messages("c12"), ids=str)
def test_abort_value_tree(m: Message) -> None:
    _, kind, payload = m.frames
    ids = plain_unpack(payload)
    assert kind == b"\x01"
    frames = encode_abort(ids)
    assert frames[0] == kind
    assert typed(plain_unpack(frames[1])) == typed(ids)
    assert frames[1] == payload


@pytest.mark.parametrize("m", messages("c07") + messages("c08"), ids=str)
def test_utility_value_tree(m: Message) -> None:
    _, kind, payload = m.frames
    client_index, call_id, method, args = plain_unpack(payload)
    frames = encode_utility(client_index, call_id, method, args)
    assert frames[0] == kind == b"\x03"
    assert typed(plain_unpack(frames[1])) == typed([client_index, call_id, method, args])
    assert frames[1] == payload
    if m.name.startswith("c07"):
        assert f"call_id={call_id}" in m.log


#: SamplingParams attribute for each wire key the captured ADDs use.
_WIRE_TO_ATTR = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
    "max_tokens": "max_tokens", "min_tokens": "min_tokens", "logprobs": "logprobs",
    "prompt_logprobs": "prompt_logprobs", "ignore_eos": "ignore_eos",
    "_eos_token_id": "eos_token_id", "skip_reading_prefix_cache": "skip_reading_prefix_cache",
}


def _well_formed_requests() -> list[Message]:
    return [m for m in messages("c") if not m.name.startswith("c15")]


@pytest.mark.parametrize("m", _well_formed_requests(), ids=str)
def test_mock_engine_side_decodes_every_well_formed_request(m: Message) -> None:
    _, kind, payload = m.frames
    plain = plain_unpack(payload)
    decoded = decode_request([kind, payload])
    if kind == b"\x01":
        assert isinstance(decoded, AbortRequest)
        assert list(decoded.request_ids) == plain
        return
    if kind == b"\x03":
        assert isinstance(decoded, UtilityRequest)
        assert [decoded.client_index, decoded.call_id, decoded.method, list(decoded.args)] == \
            plain
        return
    assert kind == b"\x00"
    assert isinstance(decoded, AddRequest)
    request = decoded.request
    assert request.request_id == plain[0]
    assert list(request.prompt_token_ids) == plain[1]
    assert request.arrival_time == plain[5]
    assert type(request.arrival_time) is float
    assert (request.lora_request, request.cache_salt, request.data_parallel_rank) == (
        plain[6], plain[7], plain[8])
    wire = plain[3]
    assert decoded.sampling_wire == wire
    params = request.sampling_params
    for key, value in wire.items():
        if key in _WIRE_TO_ATTR:
            assert getattr(params, _WIRE_TO_ATTR[key]) == value, key
    assert params.stop_token_ids == tuple(wire.get("stop_token_ids") or ())
    assert params.max_tokens == request.max_tokens == wire.get("max_tokens", 16)
    if len(plain) > 11:
        assert (request.client_index, request.current_wave, request.priority) == tuple(
            plain[11:14])


def test_every_captured_request_kind_is_covered() -> None:
    names = {m.name[:3] for m in _well_formed_requests()}
    assert {"c05", "c06", "c07", "c08", "c09", "c10", "c12", "c13", "c14"} <= names


@pytest.mark.parametrize("m", messages("c15"), ids=str)
def test_malformed_add_is_rejected(m: Message) -> None:
    assert m.log == "prompt_token_ids are strings"
    assert "NO RESPONSE" in run_results(m.folder)["results"]["H_after_malformed"]
    _, kind, payload = m.frames
    with pytest.raises(ProtocolError, match=r"EngineCoreRequest\.prompt_token_ids"):
        decode_request([kind, payload])


def test_out_of_vocab_add_decodes_but_fails_client_validation() -> None:
    m = find(OOV_VARIANT, "c16_ADD_out_of_vocab")
    vocab = int(re.search(r"vocab (\d+)", m.log).group(1))  # type: ignore[union-attr]
    bad = int(re.search(r"token id (\d+)", m.log).group(1))  # type: ignore[union-attr]
    decoded = decode_request(m.frames[1:])
    assert isinstance(decoded, AddRequest)
    index = list(decoded.request.prompt_token_ids).index(bad)
    with pytest.raises(InvalidRequestError) as caught:
        decoded.request.validate(vocab_size=vocab)
    assert caught.value.field == f"prompt_token_ids[{index}]"
