"""Start-up failure, stop and death of REAL vLLM engines (each test owns its engine)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import psutil
import pytest

from anyio_genout import Client, EngineDeadError, GenerateRequest, SamplingParams
from anyio_genout.vllm import EngineProcessExitedError, VllmEngines, spawn_vllm_engines

from .conftest import INTEROP_TIMEOUT, PROMPT, RealVllm, free_port, running_client, unique_id

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(INTEROP_TIMEOUT)]


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]


def alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


async def wait_all_gone(pids: list[int], limit: float = 10.0) -> None:
    with anyio.fail_after(limit):
        while True:
            if not any(alive(pid) for pid in pids):
                return
            await anyio.sleep(0.05)


async def wait_tree(engines: VllmEngines, size: int, limit: float = 120.0) -> list[int]:
    """The engine's process tree once it has ``size`` processes (supervisor, core, worker)."""
    with anyio.fail_after(limit):
        while True:
            tree = process_tree(engines.pids[0])
            if len(tree) >= size:
                return tree
            await anyio.sleep(0.1)


async def test_sigkill_mid_stream_fails_the_stream_within_two_seconds(
        real_vllm: RealVllm) -> None:
    async with running_client(real_vllm) as (engines, client):
        tree = await wait_tree(engines, 3)
        request = GenerateRequest(request_id=unique_id("killed"), prompt_token_ids=PROMPT,
                                  sampling_params=SamplingParams(temperature=0.0,
                                                                 max_tokens=400,
                                                                 ignore_eos=True))
        killed_at: float | None = None
        received = 0
        with pytest.raises(EngineDeadError) as info:
            async with client.generate(request) as stream:
                async for out in stream:
                    received += len(out.token_ids)
                    if received >= 5 and killed_at is None:
                        # The supervisor only: a real engine sends nothing when it dies
                        # this way, so only the process watcher can tell the client.
                        os.kill(engines.pids[0], signal.SIGKILL)
                        killed_at = time.monotonic()
        assert killed_at is not None
        assert time.monotonic() - killed_at < 2.0
        assert "exited with code -9" in str(info.value)
        assert not client.engine.is_healthy
        assert isinstance(client.engine.health_error, EngineDeadError)
        error = engines.exit_error
        assert isinstance(error, EngineProcessExitedError) and error.exit_code == -9
        # Later calls fail at once with the same kind of error.
        with anyio.fail_after(2), pytest.raises(EngineDeadError):
            await client.engine.get_supported_tasks()
        # The orphaned EngineCore and Worker were killed with the process group.
        await wait_all_gone(tree)


async def test_leaving_the_block_stops_every_engine_process(real_vllm: RealVllm) -> None:
    async with running_client(real_vllm) as (engines, client):
        tree = await wait_tree(engines, 3)
        out = await _short_generate(client)
        assert len(out) == 2
    assert not any(alive(pid) for pid in tree)
    assert engines.exit_error is None
    assert engines.returncodes[0] is not None


async def test_cancelled_mid_stream_leaves_no_process(real_vllm: RealVllm) -> None:
    tree: list[int] = []
    with anyio.CancelScope() as scope:
        async with running_client(real_vllm) as (engines, client):
            tree = await wait_tree(engines, 3)
            request = GenerateRequest(request_id=unique_id("cancel"), prompt_token_ids=PROMPT,
                                      sampling_params=SamplingParams(
                                          temperature=0.0, max_tokens=400, ignore_eos=True))
            async with client.generate(request) as stream:
                async for _ in stream:
                    scope.cancel()
    assert scope.cancelled_caught and tree
    assert not any(alive(pid) for pid in tree)


async def test_an_engine_that_cannot_start_reports_its_log(real_vllm: RealVllm,
                                                           tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    seen: list[EngineDeadError] = []
    async with spawn_vllm_engines(missing, handshake_address=f"tcp://127.0.0.1:{free_port()}",
                                  command=real_vllm.command) as engines:
        engines.on_exit(seen.append)
        with anyio.fail_after(120):
            codes = await engines.wait()
    assert codes[0] not in (0, None)
    error = engines.exit_error
    assert isinstance(error, EngineProcessExitedError)
    assert seen == [error]
    assert error.log_tail, "the engine's output should have been captured"
    assert any("no-such-model" in line for line in error.log_tail), error.log_tail[-10:]


async def _short_generate(client: Client) -> list[int]:
    request = GenerateRequest(request_id=unique_id("short"), prompt_token_ids=PROMPT,
                              sampling_params=SamplingParams(temperature=0.0, max_tokens=2))
    async with client.generate(request) as stream:
        collected = await stream.collect_output()
    return collected.token_ids
