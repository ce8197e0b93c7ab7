"""Prefix-aware routing through the real client and real mock engines over ZeroMQ: a request
follows its system prompt to the engine that cached it (and gets the hits), pinning still
wins, and the engines' cached-token counts correct the router's memory."""

from __future__ import annotations

from typing import Any

import pytest

from anyio_genout import EngineCoreClient, RoutingConfig, SamplingParams
from anyio_genout.engine.routing import PrefixRouter
from anyio_genout.protocol import EngineCoreRequest
from tests.cluster import mock_cluster

pytestmark = pytest.mark.anyio

BS = 16


def system(n: int) -> list[int]:
    return [100 * (n + 1) + i for i in range(4 * BS)]  # four whole blocks


def req(rid: str, prompt: list[int], **kw: Any) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=2),
                             arrival_time=0.0, **kw)


async def run(client: EngineCoreClient, request: EngineCoreRequest) -> tuple[int, int]:
    """(engine, num_cached_tokens of the first output) of ``request`` run to its end."""
    cached = -1
    async with client.call(request) as stream:
        async for item in stream:
            if cached < 0:
                assert item.output.prefill_stats is not None
                cached = item.output.prefill_stats.num_cached_tokens
    return stream.engine_index, cached


async def test_a_request_follows_its_system_prompt_to_the_engine_that_cached_it() -> None:
    async with mock_cluster(2, routing=RoutingConfig("prefix")) as cluster:
        client = cluster.client
        async with client.call(req("a0", [*system(0), 1, 2])) as a0, \
                client.call(req("b0", [*system(1), 1, 2])) as b0:
            assert (a0.engine_index, b0.engine_index) == (0, 1)  # new prompts: by load
            for stream in (a0, b0):
                async for _ in stream:
                    pass
        # Both engines idle: load-only routing would send both to engine 0 (the first).
        assert await run(client, req("b1", [*system(1), 3, 4])) == (1, 4 * BS)
        assert await run(client, req("a1", [*system(0), 3, 4])) == (0, 4 * BS)
        # Pinning still wins over the prefix (and teaches the router engine 0 has it too).
        assert await run(client, req("b2", [*system(1), 5], data_parallel_rank=0)) == (0, 0)
        stats = client.router.stats
        assert (stats.by_prefix, stats.by_load, stats.pinned) == (2, 2, 1)
        assert stats.corrections == 0


async def test_an_engine_that_evicted_corrects_the_router() -> None:
    # The engine keeps 5 blocks, far fewer than the KV cache it reports (the router's cap).
    async with mock_cluster(1, mock={"prefix_cache_blocks": 5},
                            routing=RoutingConfig("prefix")) as cluster:
        client = cluster.client
        router = client.router
        assert isinstance(router, PrefixRouter)
        before = router.capacity(0)
        assert await run(client, req("a0", [*system(0), 1])) == (0, 0)
        for n in (1, 2):  # evicts prompt 0 from the engine; the router still remembers it
            await run(client, req(f"x{n}", [*system(n), 1]))
        assert await run(client, req("a1", [*system(0), 2])) == (0, 0)
        assert router.stats.corrections == 1
        assert router.stats.expected_cached_tokens == 4 * BS
        assert router.capacity(0) == before - 4


async def test_load_routing_is_the_default_and_ignores_prefixes() -> None:
    async with mock_cluster(2) as cluster:  # the default routing
        client = cluster.client
        assert client.config.routing.mode == "load"
        await run(client, req("a0", [*system(0), 1]))
        async with client.call(req("hold", [1, 2, 3])) as hold:
            assert hold.engine_index == 0
            assert await run(client, req("a1", [*system(0), 2])) == (1, 0)
            client.engine_load()  # scores are floats now (the KV penalty); still readable
