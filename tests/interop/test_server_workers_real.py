"""``anyio-genout serve --workers 2`` in front of ONE real vLLM engine per backend.

The engine is a real vLLM 0.32 CPU engine core started headless by the interop fixtures
(:func:`~anyio_genout.vllm.spawn_vllm_engines`), loading ``test_text_real``'s tiny model (its
weights with the bundled tokenizer); it dials the handshake address of a supervisor started
the way a user starts it: ``anyio-genout serve --workers 2 --port 0 --model DIR
--handshake-address tcp://127.0.0.1:P``. The supervisor's INIT names both workers' input and
output addresses, so the one engine connects to both and answers each request on the output
socket of the ``client_index`` (0 or 1) it came with.

Which worker serves a connection is read from the workers' open sockets (psutil), so every
check is exact rather than statistical: each test holds keep-alive connections pinned to
each worker (checked again on every response) and reads each worker's own ``/metrics``.
What a user notices: both workers stream from the engine at the same time; greedy text is
the same whichever worker answers and on every run (and the single-process server's answer,
``test_server_real``); a client that hangs up mid-stream costs one abort on its worker and
leaves the engine free; SIGINT stops the supervisor (exit 130) and both workers, and the
headless engine outlives its front end as vLLM's own does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anyio_genout.text import Tokenizer
from anyio_genout.vllm import VllmEngines, spawn_vllm_engines
from tests.cli.support import Output, cli_process, running
from tests.server.support import open_sse
from tests.support import sse_lines

from .conftest import GREEDY_16, INTEROP_TIMEOUT, RealVllm, free_port
from .conftest import PROMPT as PROMPT_IDS
from .test_text_real import PROMPT, text_model

__all__ = ["text_model"]  # the fixture this module reuses

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(INTEROP_TIMEOUT)]

MODEL = "tiny"
#: Streams on each worker at once (test_both_workers_stream_from_the_one_engine...).
PER_WORKER = 3
#: The engine's max_model_len: longer than the interop default (512, the model allows 2048),
#: so that a stream outlasts a loaded server's delays. The tiny model makes a step in about a
#: millisecond, and a busy worker can see its first outputs late: a dropped 480-token stream
#: had sometimes been finished by the engine before the hang-up reached the worker.
MAX_MODEL_LEN = 2048
#: Long enough that six streams overlap, and that each worker's /metrics is read many times
#: while they do: the engine sends its scheduler stats to one worker per step, and with
#: 1000 tokens a loaded machine (the CPU engine's threads take both cores) let the watchers
#: read only 3-4 times in all, sometimes none from that worker while all six ran.
STREAM_TOKENS = 1800
#: The dropped streams': the engine cannot finish them before the hang-up.
DROPPED_TOKENS = 2000
SERVING = re.compile(r"serving 'tiny' on (http://\S+) with 2 workers")

_log = logging.getLogger("tests.interop")


@dataclasses.dataclass
class Cluster:
    """The engine, the supervisor and its two workers."""

    engines: VllmEngines
    supervisor: anyio.abc.Process
    output: Output
    base: str
    workers: tuple[int, int]
    tokenizer: Tokenizer

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def owner(self, client_port: int) -> int | None:
        """The worker holding the server side of the connection from ``client_port``."""
        for pid in self.workers:
            for conn in psutil.Process(pid).net_connections("tcp"):
                if (conn.laddr and conn.laddr.port == self.port and conn.raddr
                        and conn.raddr.port == client_port):
                    return pid
        return None


@pytest.fixture(scope="module")
async def cluster(real_vllm: RealVllm, text_model: Path,
                  anyio_backend: str) -> AsyncIterator[Cluster]:
    """A headless real engine and ``serve --workers 2`` (on the test's backend) in front."""
    address = f"tcp://127.0.0.1:{free_port()}"
    async with spawn_vllm_engines(str(text_model), handshake_address=address,
                                  command=real_vllm.command, logger=_log,
                                  extra_args=("--max-model-len", str(MAX_MODEL_LEN)),
                                  ) as engines, \
            cli_process("serve", "--workers", "2", "--port", "0", "--backend", anyio_backend,
                        "--model", str(text_model), "--served-model-name", MODEL,
                        "--handshake-address", address, "--advertised-host", "127.0.0.1",
                        "--ready-timeout", "240", "--keep-alive-timeout", "600",
                        ) as (supervisor, output):
        with anyio.fail_after(INTEROP_TIMEOUT - 30):
            while not (found := SERVING.search(output.err)):
                assert running(supervisor, output)
                assert engines.running, (engines.exit_error,
                                         "\n".join(engines.log_tail[-30:]))
                await anyio.sleep(0.1)
        workers = sorted(child.pid for child in psutil.Process(supervisor.pid).children())
        assert len(workers) == 2, workers
        yield Cluster(engines, supervisor, output, found.group(1), (workers[0], workers[1]),
                      Tokenizer.from_model_dir(text_model))


def _client_port(response: httpx.Response) -> int:
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


@pytest.fixture
async def pinned(cluster: Cluster) -> AsyncIterator[dict[int, list[httpx.AsyncClient]]]:
    """``PER_WORKER + 1`` HTTP clients per worker, each with one keep-alive connection that
    the worker holds (new connections until each worker had that many)."""
    assert cluster.supervisor.returncode is None, cluster.output.err
    clients: dict[int, list[httpx.AsyncClient]] = {pid: [] for pid in cluster.workers}
    async with AsyncExitStack() as stack:
        for _ in range(100):
            client = await stack.enter_async_context(httpx.AsyncClient(
                base_url=cluster.base, timeout=60,
                limits=httpx.Limits(max_connections=1, keepalive_expiry=600)))
            response = await client.get("/health")
            assert response.status_code == 200, response.text
            owner = cluster.owner(_client_port(response))
            assert owner is not None
            if len(clients[owner]) <= PER_WORKER:
                clients[owner].append(client)
            if all(len(pinned) > PER_WORKER for pinned in clients.values()):
                break
        assert all(len(pinned) > PER_WORKER for pinned in clients.values()), clients
        yield clients


def _on(cluster: Cluster, pid: int, response: httpx.Response) -> httpx.Response:
    """``response``, after checking that worker ``pid`` answered it."""
    owner = cluster.owner(_client_port(response))
    # None: no worker holds it any more (closed after this response); another pid: the
    # pinned connection had been closed, and its client reconnected to the other worker.
    assert owner == pid, (f"the connection moved: worker {pid} answered on it before, now "
                          f"{owner}; response headers {dict(response.headers)}")
    return response


def _sample(text: str, name: str, **labels: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


async def _finished(cluster: Cluster, pid: int, client: httpx.AsyncClient) -> dict[str, float]:
    """Worker ``pid``'s ``vllm:request_success_total`` by finish reason."""
    text = _on(cluster, pid, await client.get("/metrics")).text
    return {reason: _sample(text, "vllm:request_success_total", finished_reason=reason)
            for reason in ("abort", "stop", "length", "error")}


def _completion(prompt: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            **extra}


async def test_both_workers_stream_from_the_one_engine_at_the_same_time(
        cluster: Cluster, pinned: dict[int, list[httpx.AsyncClient]]) -> None:
    """Three long streams on each worker at once (clients 1-3 of each); client 0 of each
    reads that worker's /metrics meanwhile."""
    before = {pid: await _finished(cluster, pid, clients[0])
              for pid, clients in pinned.items()}
    usage: list[dict[str, Any]] = []
    running: list[float] = []

    async def stream(pid: int, client: httpx.AsyncClient) -> None:
        body = _completion(PROMPT, STREAM_TOKENS, ignore_eos=True, stream=True,
                           stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert _on(cluster, pid, response).status_code == 200
            events = [line.removeprefix("data: ") async for line in sse_lines(response)
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        usage.append(json.loads(events[-2])["usage"])

    async def watch(pid: int, client: httpx.AsyncClient) -> None:
        """The engine's own count of running requests, as this worker last heard it (every
        50 ms: Hypercorn closes a connection after 1000 requests, unpinning it). It ends
        between requests: one cancelled mid-way would close the pinned connection."""
        while not streamed.is_set():
            text = _on(cluster, pid, await client.get("/metrics")).text
            running.append(_sample(text, "vllm:num_requests_running"))
            await anyio.sleep(0.05)

    streamed = anyio.Event()
    with anyio.fail_after(120):
        async with anyio.create_task_group() as watchers:
            for pid, clients in pinned.items():
                watchers.start_soon(watch, pid, clients[0])
            async with anyio.create_task_group() as tg:
                for pid, clients in pinned.items():
                    for client in clients[1:]:
                        tg.start_soon(stream, pid, client)
            streamed.set()
    assert len(usage) == 2 * PER_WORKER
    assert all(u["completion_tokens"] == STREAM_TOKENS for u in usage), usage
    # The engine ran more requests at once than one worker had: both workers' at once.
    assert max(running) > PER_WORKER, (len(running), sorted(set(running)))
    # Each worker got its own three answers from the engine (client_index 0 and 1), and
    # counts exactly those.
    for pid, clients in pinned.items():
        after = await _finished(cluster, pid, clients[0])
        assert after["length"] - before[pid]["length"] == PER_WORKER, (pid, before, after)
        assert after["abort"] == before[pid]["abort"] and after["error"] == 0


async def test_greedy_text_is_the_same_on_both_workers_and_every_run(
        cluster: Cluster, pinned: dict[int, list[httpx.AsyncClient]]) -> None:
    """Twice on each worker, for the prompt's token ids (the model's known greedy tokens,
    which the single-process server answers too) and for a text prompt."""
    expected = cluster.tokenizer.decode(list(GREEDY_16))
    texts: dict[str, list[str]] = {"ids": [], "text": []}
    for _ in range(2):
        for pid, clients in pinned.items():
            for kind, prompt in (("ids", list(PROMPT_IDS)), ("text", PROMPT)):
                response = _on(cluster, pid, await clients[0].post(
                    "/v1/completions", json=_completion(prompt, len(GREEDY_16))))
                assert response.status_code == 200, response.text
                choice = response.json()["choices"][0]
                assert choice["finish_reason"] == "length", choice
                texts[kind].append(choice["text"])
    assert texts["ids"] == [expected] * 4
    assert texts["text"][0].strip() and texts["text"] == [texts["text"][0]] * 4, texts


async def test_streams_dropped_mid_way_are_aborted_once_each_and_the_engine_is_free(
        cluster: Cluster, pinned: dict[int, list[httpx.AsyncClient]]) -> None:
    """Hang up (a raw socket closed) after a few events of long streams, until each worker
    had one: each worker counts one abort per stream it lost, nothing finishes otherwise."""
    before = {pid: await _finished(cluster, pid, clients[0])
              for pid, clients in pinned.items()}
    dropped = dict.fromkeys(cluster.workers, 0)
    body = _completion(PROMPT, DROPPED_TOKENS, ignore_eos=True, stream=True)
    for _ in range(40):
        try:
            conn = await open_sse(cluster.base, body, events=3)
        except TimeoutError:
            raise AssertionError(f"no 3 events within 5 s; the server said:\n"
                                 f"{cluster.output.err[-3000:]}") from None
        owner = cluster.owner(conn.extra(anyio.abc.SocketAttribute.local_port))
        await conn.aclose()
        assert owner is not None
        dropped[owner] += 1
        if all(dropped.values()):
            break
    assert all(dropped.values()), dropped

    async def moved() -> dict[int, dict[str, float]]:
        now = {pid: await _finished(cluster, pid, clients[0])
               for pid, clients in pinned.items()}
        return {pid: {reason: now[pid][reason] - before[pid][reason] for reason in now[pid]}
                for pid in now}

    expected = {pid: {"abort": float(count), "stop": 0.0, "length": 0.0, "error": 0.0}
                for pid, count in dropped.items()}
    # A deadline, not a cancel scope: a timeout landing inside a /metrics request would
    # discard that pinned connection (the next request then opens a new one, on either worker).
    deadline = anyio.current_time() + 10
    while await moved() != expected and anyio.current_time() < deadline:  # noqa: ASYNC110
        await anyio.sleep(0.05)  # polling the workers' counters
    await anyio.sleep(0.5)  # time for a second count, if there were one
    assert await moved() == expected, cluster.output.err[-3000:]
    # The engine is free: a new request on each worker completes at once.
    for pid, clients in pinned.items():
        with anyio.fail_after(30):
            response = _on(cluster, pid, await clients[0].post(
                "/v1/completions", json=_completion(list(PROMPT_IDS), len(GREEDY_16))))
        assert response.json()["choices"][0]["text"] == cluster.tokenizer.decode(
            list(GREEDY_16))


async def test_sigint_stops_the_supervisor_and_both_workers_and_leaves_the_engine(
        cluster: Cluster) -> None:
    """Last in the module: it stops the module's server."""
    assert cluster.supervisor.returncode is None, cluster.output.err
    cluster.supervisor.send_signal(signal.SIGINT)
    with anyio.fail_after(30):
        assert await cluster.supervisor.wait() == 130, cluster.output.err
    with anyio.fail_after(10):
        while any(_alive(pid) for pid in cluster.workers):  # noqa: ASYNC110 - processes
            await anyio.sleep(0.05)
    # A headless vLLM engine outlives its front end (as with vLLM's own API server); the
    # fixture stops it.
    await anyio.sleep(1)
    assert cluster.engines.running, cluster.engines.exit_error


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
