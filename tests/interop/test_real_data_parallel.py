"""Two REAL engine cores behind one client (data parallel, one ``vllm serve`` launch).

Needs about 4 GB of free memory (two EngineCore and two Worker processes); skipped otherwise.
The engines are started with this package's own default command
(``python -m anyio_genout.vllm.cli``) when vLLM is importable here, so that path is covered too.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import anyio
import psutil
import pytest

from anyio_genout import Client, GenerateRequest, SamplingParams
from anyio_genout.vllm import VllmEngines, default_vllm_command

from .conftest import GREEDY_16, INTEROP_TIMEOUT, PROMPT, RealVllm, running_client, unique_id

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(INTEROP_TIMEOUT)]

NEEDED_MEMORY = 6 * 2**30


@pytest.fixture(scope="module")
async def two_engines(real_vllm: RealVllm) -> AsyncIterator[tuple[VllmEngines, Client]]:
    available = psutil.virtual_memory().available
    if available < NEEDED_MEMORY:
        pytest.skip(f"two engines need ~{NEEDED_MEMORY >> 30} GiB free, "
                    f"{available / 2**30:.1f} GiB available")
    command = default_vllm_command() if importlib.util.find_spec("vllm") else None
    async with running_client(real_vllm, engine_count=2, command=command) as pair:
        yield pair


async def test_both_engines_answer_the_handshake(two_engines: tuple[VllmEngines, Client]
                                                 ) -> None:
    engines, client = two_engines
    assert client.engine.engine_count == 2
    assert sorted(client.engine.ready_responses) == [0, 1]
    assert len(engines.pids) == 1  # one launch, two engine cores
    assert await client.engine.call_utility("is_sleeping") == [False, False]
    assert await client.engine.get_supported_tasks() == ("generate",)


async def test_requests_are_spread_and_both_engines_agree(
        two_engines: tuple[VllmEngines, Client]) -> None:
    _, client = two_engines
    used: dict[int, list[tuple[int, ...]]] = {}

    async def one(i: int) -> None:
        request = GenerateRequest(request_id=unique_id(f"dp{i}"), prompt_token_ids=PROMPT,
                                  sampling_params=SamplingParams(temperature=0.0,
                                                                 max_tokens=16))
        async with client.generate(request) as stream:
            out = await stream.collect_output()
            used.setdefault(stream.engine_index, []).append(tuple(out.token_ids))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
    assert sorted(used) == [0, 1], f"requests were not spread: {used.keys()}"
    # Same weights, same seed, greedy: every engine gives the golden output.
    assert all(tokens == GREEDY_16 for outs in used.values() for tokens in outs)
    registry = client.metrics.registry
    for engine in ("0", "1"):
        done = registry.get_sample_value(
            "vllm:request_success_total",
            {"model_name": "tiny", "engine": engine, "finished_reason": "length"})
        assert done is not None and done >= 1
