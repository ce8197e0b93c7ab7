"""The metrics differential: the same workload through ``vllm serve`` and through
``anyio-genout serve``, each over its own real vLLM 0.32 CPU engine (the tiny model, the same
engine flags), then every ``vllm:`` family of both ``/metrics`` compared.

``vllm serve`` runs whole (its own engine); ours is ``anyio-genout serve --model DIR
--served-model-name tiny --handshake-address ...`` before a headless engine
(:func:`~anyio_genout.vllm.spawn_vllm_engines`). The workload is sequential and greedy, with
a prompt long enough to hit the prefix cache when repeated, so the counts are deterministic:
every family ``vllm serve`` has exists in ours (but ``vllm:cache_config_info``, which an
engine does not send: docs/metrics.md), with the same type, label names and buckets; the
counters, gauges and token-count histograms have equal values, the time histograms equal
counts; both label ``model_name`` with the served name. The HTTP families
(prometheus-fastapi-instrumentator's) count the same requests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anyio_genout.vllm import spawn_vllm_engines
from anyio_genout.vllm.serve_args import CPU_TEST_ARGS, DEFAULT_ENV
from tests.cli.support import cli_process, running

from .conftest import RealVllm, free_port
from .test_text_real import text_model

__all__ = ["text_model"]  # the fixture this module reuses

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900)]

MODEL = "tiny"
#: Families ``vllm serve`` has and ours has not, and why (docs/metrics.md).
NOT_OURS = {"vllm:cache_config_info": "the engines do not send their CacheConfig"}
#: Families whose values depend on wall or engine clocks: only their counts are compared.
TIMED = ("_seconds",)
#: Two 128-token KV blocks and some: the repeats hit the prefix cache.
LONG_PROMPT = [3 + (i * 7) % 900 for i in range(300)]
WORKLOAD = [(LONG_PROMPT, 12), (LONG_PROMPT, 12), ([1, 5, 6, 7, 8], 16), (LONG_PROMPT, 5)]

_log = logging.getLogger("tests.interop")

Families = dict[str, tuple[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]]



def parse(text: str) -> Families:
    """``{family: (type, {(sample name, labels): value})}`` without the ``_created`` series."""
    return {family.name: (family.type, {
        (s.name, frozenset(s.labels.items())): s.value for s in family.samples
        if not s.name.endswith("_created")})
        for family in text_string_to_metric_families(text)
        if not family.name.endswith("_created")}  # the text format parses them apart


async def wait_healthy(base: str, alive: Callable[[], bool]) -> None:
    async with httpx.AsyncClient() as http:
        with anyio.fail_after(400):
            while True:
                assert alive(), f"the server at {base} exited"
                try:
                    if (await http.get(f"{base}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.5)


@asynccontextmanager
async def vllm_serve(real_vllm: RealVllm, model: Path) -> AsyncIterator[str]:
    port = free_port()
    log = open(os.devnull, "wb")  # noqa: SIM115, ASYNC230 - closed below
    env = {**os.environ, **DEFAULT_ENV}
    process = await anyio.open_process(
        [*real_vllm.command, "serve", str(model), "--served-model-name", MODEL,
         "--host", "127.0.0.1", "--port", str(port), *CPU_TEST_ARGS],
        stdout=log, stderr=log, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        with anyio.fail_after(420):
            await wait_healthy(base, lambda: process.returncode is None)
        yield base
    finally:
        with anyio.CancelScope(shield=True):
            process.terminate()
            with anyio.move_on_after(20):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            log.close()


@asynccontextmanager
async def ours(real_vllm: RealVllm, model: Path) -> AsyncIterator[str]:
    address = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(spawn_vllm_engines(
            str(model), handshake_address=address, command=real_vllm.command, logger=_log))
        process, output = await stack.enter_async_context(cli_process(
            "serve", "--port", str(port), "--model", str(model), "--served-model-name", MODEL,
            "--handshake-address", address, "--advertised-host", "127.0.0.1",
            "--ready-timeout", "400"))
        base = f"http://127.0.0.1:{port}"
        await wait_healthy(base, lambda: running(process, output))
        yield base


async def run_workload(base: str) -> Families:
    async with httpx.AsyncClient(timeout=120) as http:
        for prompt, max_tokens in WORKLOAD:
            done = await http.post(f"{base}/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0})
            assert done.status_code == 200, done.text
            assert done.json()["usage"]["completion_tokens"] == max_tokens
        assert (await http.get(f"{base}/v1/models")).status_code == 200
        # The engine's last statistics come after the last output: scrape until the vllm:
        # families stand still (process_* and python_* ones never do).
        previous: Families | None = None
        with anyio.fail_after(60):
            while True:
                await anyio.sleep(1.0)
                current = parse((await http.get(f"{base}/metrics")).text)
                engine_families = {k: v for k, v in current.items() if k.startswith("vllm:")}
                if engine_families == previous:
                    return current
                previous = engine_families


def _labels(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> set[str]:
    return {name for _, labels in samples for name, _ in labels}


def _les(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> set[str]:
    return {value for _, labels in samples for name, value in labels if name == "le"}


async def test_every_vllm_family_matches_vllm_serve_after_the_same_workload(
        real_vllm: RealVllm, text_model: Path, anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("one run: the servers are subprocesses, the backend does not matter")
    async with vllm_serve(real_vllm, text_model) as base:
        theirs = await run_workload(base)
    async with ours(real_vllm, text_model) as base:
        mine = await run_workload(base)

    vllm_families = {name for name in theirs if name.startswith("vllm:")}
    missing = vllm_families - set(mine) - set(NOT_OURS)
    assert not missing, f"vllm serve has families ours lacks: {sorted(missing)}"
    differences = []
    for name in sorted(vllm_families - set(NOT_OURS)):
        kind, expected = theirs[name]
        got_kind, got = mine[name]
        if (kind, _labels(expected), _les(expected)) != (got_kind, _labels(got), _les(got)):
            differences.append((name, "type/labels/buckets", kind, got_kind,
                                sorted(_labels(expected) ^ _labels(got)),
                                sorted(_les(expected) ^ _les(got))))
            continue
        for key, value in expected.items():
            sample = key[0]
            if any(t in name for t in TIMED) and not sample.endswith("_count"):
                continue
            if got.get(key) != value:
                differences.append((name, dict(key[1]), value, got.get(key)))
    assert not differences, differences
    for name in ("vllm:generation_tokens", "vllm:prefix_cache_hits"):
        [(key, value)] = [(k, v) for k, v in mine[name][1].items()]
        assert dict(key[1])["model_name"] == MODEL and value > 0, (name, value)
    # The HTTP families: the same completions counted under the same labels.
    http_key = ("http_requests_total", frozenset(
        {("handler", "/v1/completions"), ("method", "POST"), ("status", "2xx")}))
    assert theirs["http_requests"][1][http_key] == mine["http_requests"][1][http_key] == \
        len(WORKLOAD)
    for family in ("http_request_duration_seconds", "http_request_duration_highr_seconds",
                   "http_request_size_bytes", "http_response_size_bytes"):
        assert theirs[family][0] == mine[family][0], family
        assert _labels(theirs[family][1]) == _labels(mine[family][1]), family
        assert _les(theirs[family][1]) == _les(mine[family][1]), family
