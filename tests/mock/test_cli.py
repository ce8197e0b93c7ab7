"""``python -m anyio_genout.mock``: a real process, driven by a blocking pyzmq front end."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest
import zmq

from anyio_genout.mock import greedy_tokens
from anyio_genout.mock.cli import main


@contextmanager
def front_end() -> Iterator[tuple[dict[str, Any], str]]:
    ctx = zmq.Context()
    sockets = {"hs": ctx.socket(zmq.ROUTER), "in": ctx.socket(zmq.ROUTER),
               "out": ctx.socket(zmq.PULL)}
    try:
        for sock in sockets.values():
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
        addresses = {name: f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
                     for name, sock in sockets.items()}
        init = msgpack.packb({"addresses": {"inputs": [addresses["in"]],
                                            "outputs": [addresses["out"]]},
                              "parallel_config": {}})
        yield {**sockets, "init": init}, addresses["hs"]
    finally:
        for sock in sockets.values():
            sock.close()
        ctx.term()


def handshake(sockets: dict[str, Any]) -> bytes:
    identity, hello = sockets["hs"].recv_multipart()
    assert msgpack.unpackb(hello) == {"status": "HELLO", "local": False, "headless": True}
    sockets["hs"].send_multipart([identity, sockets["init"]])
    assert msgpack.unpackb(sockets["hs"].recv_multipart()[1])["status"] == "READY"
    assert sockets["in"].recv_multipart()[0] == identity
    return identity  # type: ignore[no-any-return]


@pytest.mark.parametrize(("backend", "signum"), [("asyncio", signal.SIGINT),
                                                 ("trio", signal.SIGTERM)])
def test_cli_serves_until_a_signal(backend: str, signum: int) -> None:
    with front_end() as (sockets, address):
        proc = subprocess.Popen([sys.executable, "-m", "anyio_genout.mock",
                                 "--handshake-address", address, "--rank", "0",
                                 "--step-time", "0.001", "--no-log-stats",
                                 "--backend", backend])
        try:
            identity = handshake(sockets)
            request = ["r", [1, 2, 3], None, {"temperature": 0.0, "max_tokens": 4}, None, 0.0,
                       None, None, None]
            sockets["in"].send_multipart([identity, b"\x00", msgpack.packb(request)])
            tokens: list[int] = []
            while len(tokens) < 4:
                message = msgpack.unpackb(sockets["out"].recv())
                tokens += [t for row in message[1] for t in row[1]]
            assert tokens == greedy_tokens([1, 2, 3], 4)
            proc.send_signal(signum)
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_exits_1_when_the_engine_dies() -> None:
    with front_end() as (sockets, address):
        proc = subprocess.Popen([sys.executable, "-m", "anyio_genout.mock",
                                 "--handshake-address", address, "--dead-after-steps", "0"])
        try:
            handshake(sockets)
            assert sockets["out"].recv() == b"ENGINE_CORE_DEAD"
            assert proc.wait(10) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--rank", "0"])
    assert exc.value.code == 2
    assert "handshake_address" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--backend", "curio", "--handshake-address", "tcp://127.0.0.1:1"])
