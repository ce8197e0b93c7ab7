"""A burst of connections while ``serve`` is busy waits in its listening socket's backlog
(2048) on every HTTP server: Hypercorn listens again on the socket it is given, with 100 by
default, and under a burst of 5,000 requests on trio hundreds were never answered."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import httpx
import pytest

from tests.server.support import serve_process

#: More than Hypercorn's default backlog (100), well below ours (2048).
BURST = 400


def _somaxconn() -> int:
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(_somaxconn() < BURST + 50, reason="the kernel caps listen backlogs "
                    "below the burst (net.core.somaxconn)")
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_burst_of_connections_to_a_stopped_server_waits_in_its_backlog(backend: str) -> None:
    with serve_process("--backend", backend) as server:
        server.child.send_signal(signal.SIGSTOP)  # nothing is accepted: the backlog holds
        connections: list[socket.socket] = []
        try:
            for i in range(BURST):
                try:  # the kernel completes the handshake while the backlog has room
                    connections.append(socket.create_connection(("127.0.0.1", server.port),
                                                                timeout=2))
                except OSError as exc:
                    pytest.fail(f"connection {i} of {BURST} was not taken in: {exc!r}")
        finally:
            server.child.send_signal(signal.SIGCONT)
            for connection in connections:
                connection.close()
        assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
