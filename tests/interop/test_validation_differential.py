"""Differential test of the client's one request validation against vLLM 0.32 itself.

Hypothesis generates generate requests (every field valid, edges included, except up to two
hostile fields holding anything at all: wrong types, huge integers, NaN, lone surrogates,
numpy scalars, containers msgpack cannot encode). Each runs through what ``Client.generate``
and the engine client do before sending (tests/protocol/_hostile_requests.py). Then:

* refused by the client: the error is an ``InvalidRequestError`` naming a hostile field
  (nothing else may escape); the request's raw encoding (without the validation) is then
  tried on vLLM too, for the statistics;
* accepted: the frames must be accepted by vLLM exactly as a real engine and its front end
  would: ``MsgpackDecoder(EngineCoreRequest)`` (the engine's input thread: msgspec types plus
  ``SamplingParams.__post_init__`` and ``LoRARequest.__post_init__``),
  ``Request.from_engine_core_request`` (the engine's preprocessing), ``SamplingParams.verify``
  with the model's limits (the front end's checks: vocabulary, ``max_logprobs``), the front
  end's prompt-length check, and what the worker needs later (token ids inside the
  vocabulary, a seed ``torch.Generator`` takes, a LoRA id its int64 array holds);
* either way, the mock engine's decoder goes deaf on exactly the frames vLLM's decoder
  refuses (the mock must behave as vLLM does).

Needs vLLM importable (the interop venv: ``nox -s interop --
tests/interop/test_validation_differential.py -v -s``), no engine; skipped elsewhere. It
prints the number of generated cases and how they ended.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import attrs
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from anyio_genout import EngineCoreRequest, InvalidRequestError, SamplingParams
from anyio_genout.errors import ProtocolError
from anyio_genout.generate.request import internal_request_id
from anyio_genout.protocol import AddRequest, decode_request
from anyio_genout.protocol.requests import wire_default
from tests.protocol._hostile_requests import (
    EOS,
    MAX_LOGPROBS,
    MAX_MODEL_LEN,
    VOCAB,
    Case,
    build,
    cases,
    check_refusal,
    field_root,
    run_client,
)
from tests.protocol._hyp import SCALE

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecation noise
    pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
    import torch
    from vllm.v1.engine import EngineCoreRequest as VllmEngineCoreRequest
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.serial_utils import MsgpackDecoder

pytestmark = pytest.mark.timeout(600)

#: Generated cases (at least 2000, as the issue asks).
CASES = max(1, int(2500 * SCALE))


class _ModelConfig:
    """The parts of vLLM's ModelConfig that ``SamplingParams.verify`` reads."""

    max_logprobs = MAX_LOGPROBS
    max_model_len = MAX_MODEL_LEN
    is_diffusion = False

    def get_vocab_size(self) -> int:
        return VOCAB


_DECODER = MsgpackDecoder(VllmEngineCoreRequest)


def _decoder_verdict(frames: list[bytes]) -> tuple[Any, str | None]:
    try:
        return _DECODER.decode(frames[1:]), None
    except Exception as exc:  # the engine's input thread would die: a deaf engine
        return None, f"decoder: {type(exc).__name__}: {exc}"


def _mock_verdict(frames: list[bytes]) -> str | None:
    """None if the mock engine's decoder accepts ``frames``, else why it goes deaf."""
    try:
        assert isinstance(decode_request(frames), AddRequest)
    except ProtocolError as exc:
        return str(exc)
    return None


def vllm_verdict(frames: list[bytes]) -> str | None:
    """None if vLLM accepts the ADD ``frames`` end to end, else why it does not."""
    request, refused = _decoder_verdict(frames)
    if refused is not None:
        return refused
    try:
        VllmRequest.from_engine_core_request(request, None)
    except Exception as exc:  # a request-scoped error output
        return f"preprocessing: {type(exc).__name__}: {exc}"
    params = request.sampling_params
    assert params is not None
    try:
        params.verify(_ModelConfig(), None, None, None)  # type: ignore[arg-type]
    except Exception as exc:  # the front end would refuse it
        return f"front end verify: {type(exc).__name__}: {exc}"
    prompt = request.prompt_token_ids or []
    if not 0 < len(prompt) < MAX_MODEL_LEN:
        return f"front end prompt length: {len(prompt)} (max_model_len {MAX_MODEL_LEN})"
    # What the worker needs later (it dies on a token id outside the vocabulary).
    tokens = [*prompt, *(t for words in params.bad_words_token_ids or [] for t in words),
              *params.all_stop_token_ids]
    if params.eos_token_id is not None:
        tokens.append(params.eos_token_id)
    if any(not 0 <= t < VOCAB for t in tokens):
        return f"worker: token id outside [0, {VOCAB})"
    if params.seed is not None:
        try:
            torch.Generator().manual_seed(params.seed)
        except Exception as exc:
            return f"worker seed: {type(exc).__name__}: {exc}"
    if request.lora_request is not None:
        try:
            np.zeros(1, np.int64)[0] = request.lora_request.lora_int_id
        except OverflowError as exc:
            return f"worker lora id: {exc}"
    return None


def _raw_frames(case: Case) -> list[bytes] | None:
    """The ADD frames the client would send for a refused ``case`` without its validation,
    or None if they cannot even be built (for the statistics only)."""
    try:
        request = build(case)
        engine_request = request.to_engine_request(
            internal_request_id(request.request_id, True), eos_token_id=EOS)
        if engine_request.max_tokens is None and engine_request.sampling_params.max_tokens \
                is None:
            engine_request = attrs.evolve(engine_request, max_tokens=MAX_MODEL_LEN - len(
                engine_request.prompt_token_ids))
        return [b"\x00", msgpack.packb(engine_request.to_wire(), use_bin_type=True,
                                       default=wire_default)]
    except Exception:
        return None


def test_what_the_client_accepts_vllm_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    stricter: collections.Counter[str] = collections.Counter()
    failures: list[str] = []

    @settings(max_examples=CASES, derandomize=SCALE == 1, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases())
    def differential(case: Case) -> None:
        result = run_client(case)
        outcomes["generated"] += 1
        frames = _raw_frames(case) if isinstance(result, InvalidRequestError) else result
        if frames is not None:
            # The mock engine goes deaf on exactly the frames vLLM's decoder refuses.
            vllm_deaf = _decoder_verdict(frames)[1] is not None
            mock = _mock_verdict(frames)
            assert (mock is not None) == vllm_deaf, f"mock: {mock}; vLLM: {vllm_deaf}"
            outcomes["mock decoder agrees with vLLM's"] += 1
        if isinstance(result, InvalidRequestError):
            check_refusal(case, result)
            if frames is None:
                outcomes["refused: not even encodable"] += 1
            elif vllm_verdict(frames) is not None:
                outcomes["refused: vLLM refuses too"] += 1
            else:
                outcomes["refused: vLLM would take its raw encoding"] += 1
                stricter[field_root(result.field)] += 1
            return
        verdict = vllm_verdict(result)
        if verdict is not None:
            failures.append(f"{case!r}: {verdict}")
        assert verdict is None, verdict
        outcomes["accepted by both"] += 1

    differential()
    with capsys.disabled():
        print(f"\ndifferential validation: {outcomes['generated']} generated cases")
        for key in ("accepted by both", "refused: vLLM refuses too",
                    "refused: not even encodable", "refused: vLLM would take its raw encoding",
                    "mock decoder agrees with vLLM's"):
            print(f"  {outcomes[key]:6d}  {key}")
        if stricter:
            # Mostly wrong types that to_wire would coerce (top_p=True sent as 1.0) or leave
            # out (n, min_tokens=False): refused, as the user asked for something else.
            print("  raw encoding taken, on: " + ", ".join(
                f"{k} {v}" for k, v in stricter.most_common()))
    assert not failures
    assert outcomes["generated"] >= min(CASES, 2000)
    assert outcomes["accepted by both"] >= outcomes["generated"] // 4


def _frames_for(**wire_changes: Any) -> list[bytes]:
    """A valid request's ADD frames with wire fields changed: ``sp_<key>`` in the sampling
    map, ``x<index>`` in the request array."""
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2],
                                sampling_params=SamplingParams(max_tokens=4),
                                arrival_time=1.0)
    wire = request.to_wire()
    wire[3] = dict(wire[3])  # the sampling map is memoised: change a copy
    for key, value in wire_changes.items():
        if key.startswith("sp_"):
            wire[3][key[3:]] = value
        else:
            wire[int(key[1:])] = value
    return [b"\x00", msgpack.packb(wire, use_bin_type=True)]


@pytest.mark.parametrize(("changes", "refused_by"), [
    ({}, None),
    ({"sp_extra_args": {"k": {(1, 2): 3}}}, None),  # the mock used to die on this
    ({"x6": ["a", "1", "/p"]}, "decoder"),
    ({"x6": ["a", True, "/p"]}, "decoder"),
    ({"x6": ["a", 1, None]}, "decoder"),
    ({"x6": ["a", 1]}, "decoder"),  # LoRARequest asserts a non-empty lora_path
    ({"x6": ["a", 2**63, "/p"]}, "worker lora id"),
    ({"sp_logprobs": -1}, "front end verify"),
    ({"sp_n": 2, "sp_temperature": 0.0}, "decoder"),
    ({"sp_max_tokens": None}, "preprocessing"),
    ({"x1": list(range(MAX_MODEL_LEN))}, "front end prompt length"),
])
def test_the_reference_verdicts_are_what_the_client_assumes(
        changes: dict[str, Any], refused_by: str | None) -> None:
    """Pins the vLLM behaviour the validation copies (if vLLM changes, this says where)."""
    verdict = vllm_verdict(_frames_for(**changes))
    if refused_by is None:
        assert verdict is None
    else:
        assert verdict is not None and verdict.startswith(refused_by), verdict
