"""``serve --http-server``: uvicorn (the default on asyncio and uvloop) and Hypercorn (trio,
or when asked) serve the same app and hold a hostile client to the same bounds: a request
head must come whole within ``--keep-alive-timeout`` even when it trickles in, an idle
connection is closed, a head over 16 KiB is refused, and the server goes on serving."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.cli.support import cli
from tests.server.support import serve_process
from tests.support import sse_lines_sync

#: (--backend, --http-server or None for the default), every combination that runs.
COMBINATIONS = [("asyncio", None), ("asyncio", "hypercorn"), ("asyncio", "builtin"),
                ("trio", None), ("trio", "hypercorn")]


def _line(backend: str, http_server: str | None) -> list[str]:
    line = ["--backend", backend, "--keep-alive-timeout", "0.5"]
    return line if http_server is None else [*line, "--http-server", http_server]


def _closed_after(conn: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``conn`` unanswered, sending ``trickle`` a byte
    every 0.1 s meanwhile (fails after 5 s)."""
    conn.settimeout(0.1)
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < 5:
        if sent < len(trickle):
            try:
                conn.sendall(trickle[sent:sent + 1])
            except OSError:  # closed under our feet: as good as read EOF
                return time.monotonic() - start
            sent += 1
        try:
            data = conn.recv(1000)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - start
        assert data == b"", data  # closed, not answered
        return time.monotonic() - start
    raise AssertionError("the server kept the connection open for 5 s")


def _post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


def _read_answer(conn: socket.socket) -> bytes:
    """One whole HTTP/1.1 answer from ``conn``: its head, then a ``content-length`` body
    or a chunked one up to its last chunk (5 s at most)."""
    conn.settimeout(5)
    answer = b""

    def more() -> None:
        nonlocal answer
        chunk = conn.recv(65536)
        assert chunk, answer
        answer += chunk

    while b"\r\n\r\n" not in answer:
        more()
    head = answer.partition(b"\r\n\r\n")[0]
    length = [line.split(b":", 1)[1] for line in head.lower().split(b"\r\n")
              if line.startswith(b"content-length:")]
    while (len(answer) - len(head) - 4 < int(length[0])) if length \
            else not answer.endswith(b"\r\n0\r\n\r\n"):
        more()
    return answer


@pytest.mark.parametrize(("backend", "http_server"), COMBINATIONS)
def test_hostile_connections_are_bounded_and_serving_goes_on(
        backend: str, http_server: str | None) -> None:
    with serve_process(*_line(backend, http_server)) as server:
        port = server.port
        # A head that trickles in, a byte every 0.1 s, forever: each byte came in time.
        with socket.create_connection(("127.0.0.1", port)) as conn:
            trickled = _closed_after(conn, b"POST /v1/completions HTTP/1.1\r\n" + b"x" * 200)
        # A connection that never sends anything.
        with socket.create_connection(("127.0.0.1", port)) as conn:
            idle = _closed_after(conn)
        # A keep-alive connection idle after its answer.
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n")
            conn.settimeout(5)
            assert conn.recv(1000).startswith(b"HTTP/1.1 200")
            after_answer = _closed_after(conn)
        # The same after a completion, whole and streamed: on trio, Hypercorn's own
        # disconnect after the last body cancelled its idle timer, and it stayed open.
        after_completions = []
        for stream in (False, True):
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(_post("/v1/completions", {"prompt": "Once", "max_tokens": 2,
                                                       "ignore_eos": True, "stream": stream}))
                assert _read_answer(conn).startswith(b"HTTP/1.1 200")
                after_completions.append(_closed_after(conn))
        # A head over 16 KiB: refused or cut, never kept.
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.settimeout(5)
            conn.sendall(b"GET /ping HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000)
            answer = b""
            try:
                while chunk := conn.recv(65536):
                    answer += chunk
            except ConnectionResetError:
                pass
            assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]
        # Still serving, streams included.
        body = {"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body,
                          timeout=30) as streamed:
            events = [line for line in sse_lines_sync(streamed) if line.startswith("data: ")]
    assert trickled < 3 and idle < 3 and after_answer < 3, (trickled, idle, after_answer)
    assert all(after < 3 for after in after_completions), after_completions
    assert events[-1] == "data: [DONE]"
    assert sum(len(json.loads(e[6:])["choices"][0]["text"]) > 0 for e in events[:-1]) >= 1


@pytest.mark.parametrize(("line", "message"), [
    (["--backend", "trio", "--http-server", "uvicorn"],
     "--http-server uvicorn runs on asyncio only"),
    (["--read-timeout", "60"], "--read-timeout is not uvicorn's; add --http-server builtin"),
    (["--http-server", "granian"], "argument --http-server: invalid choice: 'granian'"),
])
def test_combinations_that_cannot_run_are_exit_2(line: list[str], message: str) -> None:
    done = cli("serve", *line)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr


def test_hypercorn_takes_the_read_timeout() -> None:
    with serve_process("--http-server", "hypercorn", "--read-timeout", "60") as server:
        assert httpx.get(f"{server.base}/ping").status_code == 200
