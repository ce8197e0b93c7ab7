"""Explicit close with a cause, min_tokens for stop sequences, resolved max_tokens, config."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client import CollectorRegistry

from anyio_genout import AbortCause, Client, ClientConfig, FinishReason
from anyio_genout.protocol import EngineCoreFinishReason
from tests.engine.fake import Cluster

from .support import finished_counts, histogram_count, output, request, sample, scrape

pytestmark = pytest.mark.anyio


async def test_close_with_a_cause_records_it_and_aborts_once() -> None:
    async with Cluster() as (engine_client, (engine,)):
        client = Client(engine_client, ClientConfig(model_name="close-cause"))
        async with client.generate(request("r")) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [5])])
            async for _ in stream:
                stream.close(AbortCause.STOP_STRING_MATCHED)
            assert [o async for o in stream] == []  # a closed stream ends
        abort = await engine.receive_abort()
        assert abort.request_ids == (internal,)
        await engine.expect_nothing(0.1)
        assert finished_counts(client) == {"stop": 1}


async def test_stop_sequences_wait_for_min_tokens() -> None:
    async with Cluster() as (engine_client, (engine,)):
        client = Client(engine_client, ClientConfig(model_name="stop-min"))
        req = request("r", max_tokens=10, min_tokens=4, stop_token_sequences=[[5, 6]])
        async with client.generate(req) as stream:
            internal = (await engine.receive_add()).request.request_id
            await engine.send([output(internal, [5, 6, 7])])  # ends at token 2 < min_tokens
            await engine.send([output(internal, [5, 6, 8])])  # ends at token 5 >= 4
            outs = [o async for o in stream]
        assert [t for o in outs for t in o.token_ids] == [5, 6, 7, 5, 6]
        assert outs[-1].finish_reason == FinishReason.stop((5, 6))


async def test_unset_max_tokens_is_recorded_as_the_engine_applies_it() -> None:
    async with Cluster() as (engine_client, (engine,)):
        client = Client(engine_client, ClientConfig(model_name="max-tokens"))
        async with client.generate(request("r", max_tokens=None)) as stream:
            add = await engine.receive_add()
            internal = add.request.request_id
            assert add.request.max_tokens == 4096 - 2  # max_model_len - prompt length
            await engine.send([output(internal, [1], EngineCoreFinishReason.LENGTH)])
            [o async for o in stream]
        assert sample(scrape(client), "vllm:request_params_max_tokens_sum", 0,
                      "max-tokens") == 4094.0
        assert histogram_count(client, "vllm:request_params_max_tokens") == 1.0


async def test_a_shared_registry_can_be_reused_by_the_next_connection() -> None:
    registry = CollectorRegistry()
    for _ in range(2):
        cluster = Cluster()
        config = ClientConfig(engine=cluster.config, model_name="shared", registry=registry)
        async with anyio.create_task_group() as tg:
            for fake in cluster.engines:
                tg.start_soon(fake.handshake, cluster.address)
            async with Client.connect(config) as client:
                assert client.metrics.registry is registry
        for fake in cluster.engines:
            fake.close()


def test_log_stats_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="log_stats_interval"):
        ClientConfig(log_stats_interval=0)


async def test_a_sampling_mask_mismatch_fails_only_that_request() -> None:
    from anyio_genout import SamplingMaskMismatchError

    from .support import mask

    async with Cluster() as (engine_client, (engine,)):
        client = Client(engine_client, ClientConfig(model_name="mask-mismatch"))
        async with client.generate(request("bad")) as bad, \
                client.generate(request("good")) as good:
            bad_id = (await engine.receive_add()).request.request_id
            good_id = (await engine.receive_add()).request.request_id
            await engine.send([output(bad_id, [1, 2], new_sampling_mask=mask([1, 5])),
                               output(good_id, [3], EngineCoreFinishReason.LENGTH)])
            with pytest.raises(SamplingMaskMismatchError, match="1 rows for 2"):
                await bad.__anext__()
            assert [o.token_ids async for o in good] == [[3]]
        assert engine_client.is_healthy
        assert (await engine.receive_abort()).request_ids == (bad_id,)
