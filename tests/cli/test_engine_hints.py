"""What the command line says while it waits for remote engines, as a user reads it.

* For a ``tcp://`` handshake address: the ``vllm serve --headless`` line that starts them.
* For an ``ipc://`` one: that vLLM's engines dial only tcp (their handshake address is built
  from ``--data-parallel-address`` and ``--data-parallel-rpc-port``), not flags made of the
  pieces of the path; the mock engine, which takes any ZeroMQ address, dials it.
* Only once the address is bound: a bind that fails prints its error, no invitation.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from .support import cli, free_port

#: The command line's backends; its uvloop runs where the suite's uvloop cases run.
BACKENDS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.uvloop), "trio"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tcp_address_gets_the_vllm_command(backend: str) -> None:
    port = free_port()
    done = cli("generate", "--prompt-token-ids", "1,2,3", "--handshake-address",
               f"tcp://127.0.0.1:{port}", "--ready-timeout", "0.5", "--backend", backend)
    assert done.returncode == 1
    assert (f"  vllm serve <model> --headless --data-parallel-address 127.0.0.1 "
            f"--data-parallel-rpc-port {port} --data-parallel-size 1 "
            f"--skip-tokenizer-init") in done.stderr.splitlines()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_ipc_address_says_vllm_needs_tcp(backend: str, tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/h.sock"
    done = cli("generate", "--prompt-token-ids", "1,2,3", "--handshake-address", address,
               "--ready-timeout", "0.5", "--backend", backend)
    assert done.returncode == 1
    assert "HandshakeTimeoutError" in done.stderr  # it did wait on the ipc socket
    assert "--data-parallel-address ipc" not in done.stderr
    assert "vLLM engines dial only a tcp:// handshake address" in done.stderr
    assert f"  anyio-genout mock-engine --handshake-address {address} --rank 0" in \
        done.stderr.splitlines()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_invitation_before_a_bind_that_fails(backend: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for address in (f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/missing/dir/h.sock"):
            done = cli("generate", "--prompt-token-ids", "1,2,3", "--handshake-address",
                       address, "--ready-timeout", "5", "--backend", backend)
            assert done.returncode == 1, done.stderr
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1, done.stderr  # the error alone
            assert lines[0].startswith("anyio-genout: error: ") and address in lines[0]
            assert "waiting for" not in done.stderr and "vllm serve" not in done.stderr
