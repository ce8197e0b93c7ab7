"""The client against ONE real vLLM engine core per backend (shared by every test here).

Each test uses its own request ids: a real engine dies on a duplicate in-flight id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import prometheus_client
import pytest

from anyio_genout import (
    Client,
    CollectedGenerateOutput,
    EngineDeadError,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    UtilityCallError,
)
from anyio_genout.protocol import SchedulerStats
from anyio_genout.vllm import VllmEngines

from .conftest import GREEDY_16, INTEROP_TIMEOUT, PROMPT, RealVllm, running_client, unique_id

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(INTEROP_TIMEOUT)]


class StatsLog:
    """The latest scheduler stats per engine, and a way to wait for a condition on them."""

    def __init__(self) -> None:
        self.latest: dict[int, SchedulerStats] = {}
        self.updates = 0

    def __call__(self, engine: int, stats: SchedulerStats) -> None:
        self.latest[engine] = stats
        self.updates += 1

    async def wait_idle(self, engine: int = 0, limit: float = 10.0) -> SchedulerStats:
        """Wait for a stats update that shows no running and no waiting request."""
        with anyio.fail_after(limit):
            while True:
                stats = self.latest.get(engine)
                if stats is not None and stats.num_running_reqs == 0 \
                        and stats.num_waiting_reqs == 0:
                    return stats
                await anyio.sleep(0.02)


@pytest.fixture(scope="module")
async def served(real_vllm: RealVllm) -> AsyncIterator[tuple[VllmEngines, Client, StatsLog]]:
    async with running_client(real_vllm) as (engines, client):
        stats = StatsLog()
        client.engine.add_stats_listener(stats)
        yield engines, client, stats


@pytest.fixture
def client(served: tuple[VllmEngines, Client, StatsLog]) -> Client:
    engines, client, _ = served
    assert engines.running, f"the shared engine died: {engines.exit_error}"
    assert client.engine.is_healthy, client.engine.health_error
    return client


@pytest.fixture
def stats(served: tuple[VllmEngines, Client, StatsLog]) -> StatsLog:
    return served[2]


def greedy(max_tokens: int = 16, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


async def generate(client: Client, prompt: Sequence[int], params: SamplingParams,
                   prefix: str = "r") -> CollectedGenerateOutput:
    request = GenerateRequest(request_id=unique_id(prefix), prompt_token_ids=prompt,
                              sampling_params=params)
    async with client.generate(request) as stream:
        collected = await stream.collect_output()
    return collected


async def test_handshake_facts(served: tuple[VllmEngines, Client, StatsLog]) -> None:
    engines, client, _ = served
    assert client.engine.vllm_version == "0.32.0"
    assert client.engine.max_model_len == 512
    assert client.engine.engine_count == 1
    assert len(engines.pids) == 1 and engines.running
    assert any("0.32.0" in line or "engine" in line.lower() for line in engines.log_tail)


async def test_greedy_is_deterministic_across_runs(client: Client) -> None:
    first = await generate(client, PROMPT, greedy(16), "greedy")
    second = await generate(client, PROMPT, greedy(16), "greedy")
    assert first.token_ids == second.token_ids
    assert len(first.token_ids) == 16
    assert first.finish_reason.as_str() == "length"
    assert tuple(first.token_ids) == GREEDY_16, (
        "the tiny model's greedy output changed: was tools/build_tiny_model.py edited?")


async def test_streamed_deltas_add_up(client: Client) -> None:
    request = GenerateRequest(request_id=unique_id("stream"), prompt_token_ids=PROMPT,
                              sampling_params=greedy(8))
    tokens: list[int] = []
    reasons: list[FinishReason | None] = []
    async with client.generate(request) as stream:
        async for out in stream:
            tokens.extend(out.token_ids)
            reasons.append(out.finish_reason)
    assert tuple(tokens) == GREEDY_16[:8]
    assert all(r is None for r in reasons[:-1])
    assert reasons[-1] is not None and reasons[-1].as_str() == "length"


async def test_max_tokens_gives_length(client: Client) -> None:
    out = await generate(client, PROMPT, greedy(5), "length")
    assert tuple(out.token_ids) == GREEDY_16[:5]
    assert out.finish_reason.as_str() == "length"
    assert out.finish_reason.stop_reason is None
    assert out.usage.output_token_count == 5
    assert out.usage.prompt_token_count == len(PROMPT)


async def test_stop_token_ids_stop_with_stop_reason(client: Client) -> None:
    stop = GREEDY_16[2]
    expected = GREEDY_16[: GREEDY_16.index(stop) + 1]
    out = await generate(client, PROMPT, greedy(16, stop_token_ids=[stop]), "stop")
    assert tuple(out.token_ids) == expected  # the stop token itself is included
    assert out.finish_reason.as_str() == "stop"
    assert out.finish_reason.stop_reason == stop


async def test_eos_token_id_stops_without_stop_reason(client: Client) -> None:
    eos = GREEDY_16[2]
    expected = GREEDY_16[: GREEDY_16.index(eos) + 1]
    out = await generate(client, PROMPT, greedy(16, eos_token_id=eos), "eos")
    assert tuple(out.token_ids) == expected
    assert out.finish_reason.as_str() == "stop"
    assert out.finish_reason.stop_reason is None


async def test_ignore_eos_runs_to_max_tokens(client: Client) -> None:
    eos = GREEDY_16[2]
    out = await generate(client, PROMPT, greedy(16, eos_token_id=eos, ignore_eos=True), "noeos")
    # ignore_eos is implemented by the front end: the client must not send _eos_token_id.
    assert len(out.token_ids) == 16
    assert out.finish_reason.as_str() == "length"


async def test_logprobs_and_prompt_logprobs_shapes(client: Client) -> None:
    prompt = [1, *range(10, 50)]  # 41 tokens: prompt logprobs arrive in extra ZMQ frames
    out = await generate(client, prompt, greedy(3, logprobs=2, prompt_logprobs=5), "logprobs")
    assert len(out.token_ids) == 3
    logprobs = out.logprobs
    assert logprobs is not None and len(logprobs) == 3
    for token, position in zip(out.token_ids, logprobs.positions, strict=True):
        assert len(position) == 3  # the sampled token, then the top 2
        assert position.sampled.token_id == token  # sampled token first
        assert position[1].token_id == token and position[1].rank == 1  # greedy = top-1
        assert position[0].logprob <= 0.0
    prompt_logprobs = out.prompt_logprobs
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == len(prompt) - 1  # none for the first prompt token
    for token, position in zip(prompt[1:], prompt_logprobs.positions, strict=True):
        assert len(position) == 6  # the prompt token, then the top 5
        assert position[0].token_id == token


async def test_seeded_sampling_is_reproducible(client: Client) -> None:
    params = SamplingParams(temperature=0.7, seed=42, top_k=50, top_p=0.9, max_tokens=5)
    first = await generate(client, [1, 5, 6], params, "seeded")
    second = await generate(client, [1, 5, 6], params, "seeded")
    assert first.token_ids == second.token_ids and len(first.token_ids) == 5


async def test_leaving_the_scope_aborts_and_frees_the_request(client: Client,
                                                              stats: StatsLog) -> None:
    aborts_before = client.engine.aborts_sent
    request = GenerateRequest(request_id=unique_id("leave"), prompt_token_ids=PROMPT,
                              sampling_params=greedy(400, ignore_eos=True))
    received = 0
    async with client.generate(request) as stream:
        async for out in stream:
            received += len(out.token_ids)
            if received >= 5:
                break
    assert client.engine.in_flight == 0
    with anyio.fail_after(5):  # the ABORT frame goes out from the client's abort worker
        while True:
            if client.engine.aborts_sent >= aborts_before + 1:
                break
            await anyio.sleep(0.01)
    assert client.engine.aborts_sent == aborts_before + 1
    # A real engine sends no finish output for an ABORT; the scheduler stats of a later step
    # show that it dropped the request.
    idle = await stats.wait_idle()
    assert idle.num_running_reqs == 0
    running = client.metrics.registry.get_sample_value(
        "vllm:num_requests_running", {"model_name": "tiny", "engine": "0"})
    assert running == 0.0


async def test_client_abort_by_external_id(client: Client, stats: StatsLog) -> None:
    external = unique_id("ext")
    request = GenerateRequest(request_id=external, prompt_token_ids=PROMPT,
                              sampling_params=greedy(400, ignore_eos=True))
    tokens: list[int] = []
    reasons: list[FinishReason | None] = []
    aborted = False
    with anyio.fail_after(30):
        async with client.generate(request) as stream:
            async for out in stream:
                tokens.extend(out.token_ids)
                reasons.append(out.finish_reason)
                if len(tokens) >= 3 and not aborted:
                    aborted = True
                    await client.abort([external])
    assert reasons[-1] is not None and reasons[-1].as_str() == "abort"
    assert len(tokens) < 400
    await stats.wait_idle()


async def test_sixteen_concurrent_requests(client: Client) -> None:
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        prompt = [1, 5 + i, 6, 7, 8]
        out = await generate(client, prompt, greedy(32, ignore_eos=True), f"conc{i}")
        assert out.finish_reason.as_str() == "length"
        results[i] = out.token_ids

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
    assert sorted(results) == list(range(16))
    assert all(len(tokens) == 32 for tokens in results.values())
    # Batched, each is what it is alone (greedy): no request got another's tokens.
    for i in (0, 7, 15):
        alone = await generate(client, [1, 5 + i, 6, 7, 8], greedy(32, ignore_eos=True),
                               f"alone{i}")
        assert alone.token_ids == results[i], i


async def test_repeated_long_prompt_reports_cached_tokens(client: Client,
                                                          anyio_backend: str) -> None:
    # A prompt no other test (or backend) sends; 300 tokens = two full 128-token KV blocks.
    offset = 100 if anyio_backend == "asyncio" else 400
    prompt = [1, *((offset + i * 7) % 1000 + 4 for i in range(299))]
    first = await generate(client, prompt, greedy(4), "cache")
    second = await generate(client, prompt, greedy(4), "cache")
    assert first.usage.cached_token_count == 0
    assert second.usage.cached_token_count >= 128
    assert second.usage.cached_token_count < len(prompt)
    assert first.token_ids == second.token_ids


async def test_utility_calls(client: Client) -> None:
    engine = client.engine
    assert await engine.get_supported_tasks() == ("generate",)
    assert await engine.is_sleeping() is False
    await engine.reset_prefix_cache()
    assert await engine.call_utility("is_sleeping") == [False]
    with pytest.raises(UtilityCallError) as info:
        await engine.call_utility("no_such_method")
    assert info.value.method == "no_such_method"
    assert "has no attribute 'no_such_method'" in info.value.message
    # The engine survives a failed utility call.
    assert engine.is_healthy
    out = await generate(client, PROMPT, greedy(3), "after-utility")
    assert tuple(out.token_ids) == GREEDY_16[:3]


async def test_metrics_are_exported(client: Client) -> None:
    await generate(client, PROMPT, greedy(4), "metrics")
    registry = client.metrics.registry
    labels = {"model_name": "tiny", "engine": "0"}
    success = registry.get_sample_value(
        "vllm:request_success_total", {**labels, "finished_reason": "length"})
    assert success is not None and success >= 1
    generated = registry.get_sample_value("vllm:generation_tokens_total", labels)
    assert generated is not None and generated >= 4
    ttft = registry.get_sample_value("vllm:time_to_first_token_seconds_count", labels)
    assert ttft is not None and ttft >= 1
    text = prometheus_client.generate_latest(registry).decode()
    assert 'vllm:prompt_tokens_total{engine="0",model_name="tiny"}' in text


async def test_out_of_vocabulary_prompt_is_refused_before_sending(client: Client) -> None:
    # A real engine dies on a token id >= vocab size; the client must refuse it locally.
    with pytest.raises(Exception) as info:
        await generate(client, [1, 50_000], greedy(2), "oov")
    assert not isinstance(info.value, EngineDeadError)
    assert client.engine.is_healthy
