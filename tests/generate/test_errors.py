"""Errors: a dying engine, invalid requests, and what reaches (or does not reach) the engine."""

from __future__ import annotations

import anyio
import pytest

from anyio_genout import (
    EngineDeadError,
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
)
from anyio_genout.protocol import ENGINE_CORE_DEAD

from .support import (
    finished_counts,
    generate_cluster,
    histogram_count,
    no_resource_warnings,
    output,
    request,
)

pytestmark = pytest.mark.anyio


async def test_engine_death_mid_stream_raises_once_and_records_nothing() -> None:
    with no_resource_warnings():
        async with generate_cluster() as (client, (engine,)):
            outs: list[GenerateOutput] = []
            errors: list[BaseException] = []
            async with client.generate(request("req-dead")) as stream:
                internal = (await engine.receive_add()).request.request_id
                await engine.send([output(internal, [1])])
                try:
                    async for out in stream:
                        outs.append(out)
                        await engine.send_raw([ENGINE_CORE_DEAD])
                except EngineDeadError as exc:
                    errors.append(exc)
                with pytest.raises(StopAsyncIteration):  # exactly once, then the end
                    await stream.__anext__()
                assert [o async for o in stream] == []
            assert [o.token_ids for o in outs] == [[1]]
            assert len(errors) == 1
            assert not client.engine.is_healthy
            assert isinstance(client.engine.health_error, EngineDeadError)
            await engine.expect_nothing(0.1)  # no ABORT to a dead engine
            assert finished_counts(client) == {}  # no finished metrics on the error path
            assert histogram_count(client, "vllm:e2e_request_latency_seconds") == 0
            assert len(client.inflight) == 0
            # Later requests fail at once with the sticky error, nothing sent.
            with pytest.raises(EngineDeadError):
                async with client.generate(request("req-after")):
                    pytest.fail("entered after death")  # pragma: no cover
            assert len(client.inflight) == 0


async def test_engine_death_while_waiting_wakes_the_consumer() -> None:
    async with generate_cluster() as (client, (engine,)):
        with anyio.fail_after(2):
            async with client.generate(request("req-dead")) as stream:
                await engine.receive_add()

                async def kill() -> None:
                    await anyio.sleep(0.02)
                    await engine.send_raw([ENGINE_CORE_DEAD])

                async with anyio.create_task_group() as tg:
                    tg.start_soon(kill)
                    with pytest.raises(EngineDeadError):
                        await stream.__anext__()
        assert finished_counts(client) == {}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=5.0),
    SamplingParams(top_p=0.0),
    SamplingParams(max_tokens=0),
    SamplingParams(n=2),
    SamplingParams(stop_token_sequences=[()]),
])
async def test_invalid_sampling_params_raise_at_entry_with_nothing_sent(
        params: SamplingParams) -> None:
    async with generate_cluster() as (client, (engine,)):
        stream = client.generate(GenerateRequest(request_id="req-bad",
                                                 prompt_token_ids=[11, 22],
                                                 sampling_params=params))
        with pytest.raises(InvalidRequestError):
            async with stream:
                pytest.fail("entered an invalid request")  # pragma: no cover
        await engine.expect_nothing(0.05)
        assert len(client.inflight) == 0 and client.engine.in_flight == 0
        assert finished_counts(client) == {}
        # The client is still usable.
        async with client.generate(request("req-good")) as good:
            internal = (await engine.receive_add()).request.request_id
            assert internal.startswith("req-good-")
            await engine.send([output(internal, [], finish=None)])
            assert (await good.__anext__()).token_ids == []


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [11, 500]}, "prompt_token_ids[1]"),  # the engine's vocab_size: 100
    ({"request_id": ""}, "request_id"),
    ({"request_id": 7}, "request_id"),
    ({"request_id": "r\udc80"}, "request_id"),
])
async def test_requests_are_validated_once_at_entry_before_any_io(
        kwargs: dict[str, object], field: str) -> None:
    """The one validation runs when the scope is entered (generate() itself checks
    nothing), with the engine client's limits; nothing is sent."""
    async with generate_cluster(vocab_size=100) as (client, (engine,)):
        args: dict[str, object] = {"request_id": "req-x", "prompt_token_ids": [11, 22]}
        args.update(kwargs)
        stream = client.generate(GenerateRequest(**args))  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError) as info:
            async with stream:
                pytest.fail("entered an invalid request")  # pragma: no cover
        assert info.value.field == field
        await engine.expect_nothing(0.05)
        assert len(client.inflight) == 0 and client.engine.in_flight == 0


async def test_a_client_vocab_size_the_engine_client_does_not_share_is_refused() -> None:
    """Client(engine, config): the engine client runs the validation with its own
    vocab_size, so a different ClientConfig.vocab_size would silently go unchecked."""
    async with generate_cluster() as (client, _):
        with pytest.raises(ValueError, match=r"vocab_size=100.*EngineCoreClientConfig"):
            type(client)(client.engine, type(client.config)(model_name="vocab",
                                                            vocab_size=100))
    async with generate_cluster(vocab_size=100) as (client, _):
        with pytest.raises(ValueError, match="vocab_size=50"):
            type(client)(client.engine, type(client.config)(model_name="v50", vocab_size=50))
        same = type(client)(client.engine, type(client.config)(model_name="v100",
                                                               vocab_size=100))
        assert same.config.vocab_size == client.engine.config.vocab_size == 100
        same.metrics.unregister()


async def test_eos_token_id_is_filled_from_the_client_config() -> None:
    async with generate_cluster(eos_token_id=2) as (client, (engine,)):
        cases = {
            "default": (SamplingParams(max_tokens=4), 2),
            "explicit": (SamplingParams(max_tokens=4, eos_token_id=9), 9),
            "ignored": (SamplingParams(max_tokens=4, ignore_eos=True), 2),
        }
        for name, (params, expected) in cases.items():
            req = GenerateRequest(request_id=name, prompt_token_ids=[11, 22],
                                  sampling_params=params)
            async with client.generate(req):
                add = await engine.receive_add()
                assert add.request.sampling_params.eos_token_id == expected, name
                # An ignored EOS does not stop the request, but min_tokens holds it back
                # (vLLM sends it in _all_stop_token_ids only).
                assert add.sampling_wire.get("_eos_token_id") == (
                    None if params.ignore_eos else expected), name
                assert expected in add.sampling_wire["_all_stop_token_ids"], name
            await engine.receive_abort()
