"""Requests that would kill a real engine never leave the client.

A real vLLM 0.32 engine dies (ENGINE_CORE_DEAD) on a duplicate in-flight request id and on an
out-of-vocabulary token id, taking every other request with it, and its input thread dies
(the engine goes deaf: every later request hangs) on anything its msgspec decoder refuses;
so does the mock. The client refuses all of these locally, before any I/O, with one
validation, and the engine (and everyone else) lives on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest

from anyio_genout import (
    Client,
    ClientConfig,
    DuplicateRequestIdError,
    EngineCoreClientConfig,
    EngineDeadError,
    GenerateRequest,
    HandshakeTransport,
    InvalidRequestError,
    SamplingParams,
    collect_output,
)
from anyio_genout.generate import FinishReasonKind
from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.protocol import AddRequest
from tests.cluster import generate_client, mock_cluster
from tests.engine.fake import free_port
from tests.protocol._hostile_requests import OBSERVED, observed_request

from .support import drain, engine_request, generate_request

pytestmark = pytest.mark.anyio

VOCAB = 1000


async def test_duplicate_in_flight_id_is_refused_locally() -> None:
    async with generate_client(randomize_request_ids=False) as (client, cluster):
        async with client.generate(generate_request("dup", max_tokens=50)) as first:
            with pytest.raises(DuplicateRequestIdError, match="dup"):
                async with client.generate(generate_request("dup")):
                    pytest.fail("a duplicate was sent")  # pragma: no cover
            result = await collect_output(first)
        assert result.finish_reason is not None
        assert result.finish_reason.kind is FinishReasonKind.LENGTH
        assert cluster.engine.added_ids == ["dup"] and not cluster.engine.dead
        assert len(client.inflight) == 0 and cluster.client.in_flight == 0
        # Once finished, the id is free again.
        async with client.generate(generate_request("dup", max_tokens=2)) as again:
            assert (await collect_output(again)).finish_reason is not None


async def test_duplicate_id_on_the_raw_client_is_refused_locally() -> None:
    async with mock_cluster() as cluster:
        client = cluster.client
        async with client.call(engine_request("dup", max_tokens=20)) as stream:
            with pytest.raises(DuplicateRequestIdError):
                async with client.call(engine_request("dup")):
                    pytest.fail("a duplicate was sent")  # pragma: no cover
            items, error = await drain(stream)
        assert error is None and items[-1].output.finished
        assert cluster.engine.added_ids == ["dup"] and not cluster.engine.dead


@asynccontextmanager
async def connected_client(config: ClientConfig, **mock: Any
                           ) -> AsyncIterator[tuple[Client, MockEngine]]:
    """``Client.connect(config)`` to one mock engine (``mock``: its config)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    config = ClientConfig(
        engine=EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=10,
                                      vocab_size=config.engine.vocab_size),
        vocab_size=config.vocab_size, model_name="refusal")
    engine = MockEngine(MockEngineConfig(handshake_address=address, linger=0.5, **mock))
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.serve)
        async with Client.connect(config) as client:
            yield client, engine
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("where", ["client", "engine"])
async def test_out_of_vocabulary_prompt_token_is_refused_locally(where: str) -> None:
    """``ClientConfig.vocab_size`` reaches the engine client's one validation through
    ``Client.connect``, as ``EngineCoreClientConfig.vocab_size`` does directly."""
    config = (ClientConfig(vocab_size=VOCAB) if where == "client"
              else ClientConfig(engine=EngineCoreClientConfig(vocab_size=VOCAB)))
    async with connected_client(config, vocab_size=VOCAB) as (client, engine):
        assert client.engine.config.vocab_size == VOCAB
        async with client.generate(generate_request("ok", max_tokens=30)) as other:
            with pytest.raises(InvalidRequestError) as info:
                async with client.generate(generate_request("bad", prompt=[1, 2, VOCAB + 7])):
                    pytest.fail("an out-of-vocabulary prompt was sent")  # pragma: no cover
            assert info.value.field == "prompt_token_ids[2]"
            assert str(VOCAB + 7) in str(info.value)
            with pytest.raises(InvalidRequestError) as info:
                async with client.generate(generate_request("bad-stop",
                                                            stop_token_ids=[VOCAB])):
                    pytest.fail("an out-of-vocabulary stop token was sent")  # pragma: no cover
            assert "stop_token_ids[0]" in info.value.field
            result = await collect_output(other)
        assert result.finish_reason is not None
        assert not engine.dead and not engine.deaf and engine.errors == []
        assert [rid.split("-")[0] for rid in engine.added_ids] == ["ok"]
        assert len(client.inflight) == 0


async def test_a_client_vocab_size_the_engine_client_lacks_is_refused_up_front() -> None:
    """``Client(engine, config)`` cannot pass its vocab_size to an engine client connected
    without one: that would leave token ids unchecked, so it is a configuration error."""
    async with mock_cluster() as cluster:
        with pytest.raises(ValueError, match="EngineCoreClientConfig"):
            Client(cluster.client, ClientConfig(engine=cluster.client.config,
                                                vocab_size=VOCAB))


async def _served(client: Client, rid: str, **params: Any) -> tuple[int, ...]:
    """Generate greedily to the end (bounded: a deaf engine would never answer)."""
    with anyio.fail_after(5):
        async with client.generate(GenerateRequest(
                request_id=rid, prompt_token_ids=params.pop("prompt", [11, 22]),
                sampling_params=SamplingParams(temperature=0.0, max_tokens=4,
                                               **params))) as stream:
            result = await collect_output(stream)
    assert result.finish_reason is not None
    return tuple(result.token_ids)


async def test_requests_the_engine_would_choke_on_are_refused_by_field_and_it_lives() -> None:
    """Issue 12, item 3: each used to pass validation and then deafen the engine (LoRA),
    draw a refusal from vLLM's front end (logprobs=-1), or escape as a raw
    UnicodeEncodeError / OverflowError from ``async with client.generate()``."""
    async with generate_client() as (client, cluster):
        for kwargs, field in OBSERVED:
            with pytest.raises(InvalidRequestError) as info:
                async with client.generate(observed_request(**kwargs)):
                    pytest.fail(f"sent {kwargs}")  # pragma: no cover
            assert info.value.field == field, kwargs
        assert cluster.engine.added_ids == [] and len(client.inflight) == 0
        assert len(await _served(client, "next")) == 4  # the engine still serves
        assert not cluster.engine.deaf and cluster.engine.errors == []


async def test_extra_args_with_a_tuple_key_reach_the_engine_as_in_vllm() -> None:
    """vLLM's decoder accepts an array map key below the top level of extra_args (it becomes
    a tuple); the mock used to die on it (msgpack-python cannot hash a list)."""
    async with generate_client() as (client, cluster):
        assert len(await _served(client, "tuple-key", extra_args={"k": {(1, 2): 3}})) == 4
        assert len(await _served(client, "next")) == 4
        assert not cluster.engine.deaf and cluster.engine.errors == []
        added = [r for r in cluster.engine.received if isinstance(r, AddRequest)]
        assert added[0].sampling_wire["extra_args"] == {"k": {(1, 2): 3}}


@pytest.mark.parametrize("prompt", [
    np.array([11, 22], dtype=np.int64),
    np.array([11, 22], dtype=np.uint16),
    [np.int64(11), np.int32(22)],
])
async def test_numpy_integer_prompts_generate(prompt: Any) -> None:
    async with generate_client() as (client, _):
        assert await _served(client, "np", prompt=prompt) == await _served(client, "list")


async def test_a_huge_prompt_is_refused_by_its_length_at_once() -> None:
    """The length check against max_model_len (4096) runs before any per-token work: a
    10**6-token prompt is refused in microseconds (it took 0.2-0.3 s)."""
    async with generate_client() as (client, cluster):
        request = GenerateRequest(request_id="huge", prompt_token_ids=list(range(10**6)))
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            with pytest.raises(InvalidRequestError, match="max_model_len=4096") as info:
                async with client.generate(request):
                    pytest.fail("a huge prompt was sent")  # pragma: no cover
            best = min(best, time.perf_counter() - started)
        assert info.value.field == "prompt_token_ids"
        assert best < 0.01, f"{best * 1e3:.2f} ms"
        assert cluster.engine.added_ids == []


async def test_without_vocab_size_an_oov_token_kills_the_engine_and_every_stream() -> None:
    """Why the check matters: the engine dies and takes the innocent requests along; each
    still ends with exactly one error, nothing hangs."""
    # Paced steps: the innocent requests (1000 tokens) must still be running when the bad
    # one arrives, even on a loaded machine.
    async with generate_client(mock={"vocab_size": VOCAB, "step_time": 0.002}) as (
            client, cluster):
        errors: list[BaseException | None] = []

        async def innocent(i: int) -> None:
            async with client.generate(generate_request(f"ok{i}", max_tokens=1000)) as s:
                errors.append((await drain(s))[1])

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(innocent, i)
                await anyio.sleep(0.05)
                async with client.generate(generate_request("bad", prompt=[VOCAB + 7])) as s:
                    errors.append((await drain(s))[1])
        assert cluster.engine.dead and "out of vocabulary" in cluster.engine.errors[-1]
        assert len(errors) == 6 and all(isinstance(e, EngineDeadError) for e in errors)
