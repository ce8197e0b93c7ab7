"""Hostile request bodies against ``anyio-genout serve`` as a child process, on every
backend, many times each: whatever a client sends or however it hangs up, it gets a
well-formed answer (or none, if it left first) and the server's log shows no traceback.

Hypercorn 0.18's trio worker shuts a connection down without its send lock when the client
hangs up mid-body; a response being sent then failed with ``trio.BusyResourceError`` and an
80-line "Error in ASGI Framework" in the log (about one chunked oversize body in four whose
client closes on the answer). The hang-ups here repeat that enough times to catch it."""

from __future__ import annotations

import json
import select
import socket
import struct
from contextlib import AbstractContextManager

import httpx
import pytest

from tests.server.support import ServeProcess, serve_process

KEY = "hostile-key"
LIMIT = 1000
HEAD = (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%s\r\n")
CHUNK = b"100\r\n" + b"x" * 256 + b"\r\n"  # a 256-byte chunk: 4 of them pass LIMIT


def _server(backend: str) -> AbstractContextManager[ServeProcess]:
    """``serve`` on a free port with small limits, stopped at the end (its ``err`` is all of
    its stderr then)."""
    return serve_process("--backend", backend, "--api-key", KEY, "--max-body-size", str(LIMIT),
                         "--body-timeout", "0.5")


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.settimeout(5)
    return conn


def _answer_ready(conn: socket.socket, wait: float = 0.002) -> bool:
    return bool(select.select([conn], [], [], wait)[0])


def _read_all(conn: socket.socket) -> bytes:
    """Everything until the server closes (a ``TimeoutError`` after 5 s of silence: it must
    close after its answer)."""
    got = b""
    while True:
        try:
            data = conn.recv(65536)
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data


def _chunked_until_answered(port: int, path: bytes, headers: bytes, hang_up: str) -> bytes:
    """A chunked body that grows past the limit, 256 bytes at a time; as soon as an answer
    arrives the client reads what is there and hangs up (``close``, half-close ``shut``, or
    ``reset``); returns the answer's start."""
    conn = _connect(port)
    got = b""
    try:
        conn.sendall(HEAD % (path, headers + b"transfer-encoding: chunked\r\n"))
        for _ in range(200):
            try:
                conn.sendall(CHUNK)
            except OSError:
                break
            if _answer_ready(conn):
                got += conn.recv(65536)
                if _final(got):  # not only a "100 Continue"
                    break
        if hang_up == "shut":
            conn.shutdown(socket.SHUT_WR)
        elif hang_up == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    finally:
        conn.close()
    return got


def _whole(port: int, path: bytes, headers: bytes, body: bytes) -> bytes:
    with _connect(port) as conn:
        conn.sendall(HEAD % (path, headers + b"connection: close\r\n") + body)
        return _read_all(conn)


def _partial_then_gone(port: int, path: bytes, headers: bytes) -> None:
    """A body cut short by the client: a content-length it never fills, then a close."""
    with _connect(port) as conn:
        conn.sendall(HEAD % (path, headers + b"content-length: 500\r\n") + b'{"prompt": "x')


def _final(answer: bytes) -> bytes:
    """``answer`` without the interim "100 Continue" it may start with."""
    while answer.startswith(b"HTTP/1.1 100 ") and b"\r\n\r\n" in answer:
        answer = answer.partition(b"\r\n\r\n")[2]
    return b"" if answer.startswith(b"HTTP/1.1 100 ") else answer


def _status(answer: bytes) -> int | None:
    """The status of an answer's start (None for no answer: the client left first)."""
    answer = _final(answer)
    if not answer:
        return None
    assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    return int(answer[9:12])


AUTH = b"authorization: Bearer " + KEY.encode() + b"\r\n"

#: (what, path, headers, expected status of an answer when there is one)
HANG_UPS: list[tuple[bytes, bytes, int]] = [
    (b"/v1/completions", AUTH, 413),   # authorized, the body grows past the limit
    (b"/v1/completions", b"", 401),    # no key: refused before the body is read
    (b"/tokenize", b"", 413),          # open in the default scope: the body limit
    (b"/v1/completions", AUTH + b"expect: 100-continue\r\n", 413),
]


#: Hang-up rounds per backend, each sending every one of HANG_UPS (120 hang-ups in all, 40
#: per way of hanging up): trio's BusyResourceError came about once in four closes.
ROUNDS = 30


@pytest.mark.parametrize("backend", ["trio", "asyncio",
                                     pytest.param("uvloop", marks=pytest.mark.uvloop)])
def test_hostile_bodies_many_times_leave_no_traceback_in_the_log(backend: str) -> None:
    statuses: dict[str, set[int | None]] = {}

    def record(what: str, status: int | None) -> None:
        statuses.setdefault(what, set()).add(status)

    with _server(backend) as server:
        port = server.port
        for i in range(ROUNDS):
            for path, headers, want in HANG_UPS:
                hang_up = ("close", "shut", "reset")[i % 3]
                status = _status(_chunked_until_answered(port, path, headers, hang_up))
                assert status in (want, None), (path, headers, status)
                record(f"{path!r} {want}", status)
        for _ in range(ROUNDS // 3):
            _partial_then_gone(port, b"/v1/completions", AUTH)
            invalid = _whole(port, b"/v1/completions", AUTH + b"content-length: 9\r\n",
                             b"not json!")
            record("invalid", _status(invalid))
            bad_chunk = _whole(port, b"/v1/completions", AUTH
                               + b"transfer-encoding: chunked\r\n", b"zz\r\nxx\r\n0\r\n\r\n")
            record("bad chunk", _status(bad_chunk))
            huge = _whole(port, b"/v1/completions", AUTH + b"content-length: 10000000\r\n",
                          b"{")
            record("content-length", _status(huge))
        trickled = [_connect(port) for _ in range(5)]  # past --body-timeout: 408
        for conn in trickled:
            conn.sendall(HEAD % (b"/v1/completions", AUTH + b"content-length: 100\r\n")
                         + b'{"prompt": ')
        for conn in trickled:
            with conn:
                record("trickled", _status(_read_all(conn)))
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 2}, headers={
            "authorization": f"Bearer {KEY}"})
    err = server.err
    assert ok.status_code == 200, ok.text
    assert statuses["invalid"] == {400}
    assert statuses["bad chunk"] == {400}
    assert statuses["content-length"] == {413}
    assert statuses["trickled"] == {408}
    for path, _, want in HANG_UPS:  # most hang-ups came after the answer's start
        assert want in statuses[f"{path!r} {want}"], statuses
    assert "Error in ASGI" not in err and "Traceback" not in err, err[-3000:]
    assert KEY not in err


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_an_oversize_chunked_body_is_answered_and_the_connection_closed(backend: str) -> None:
    """However many chunks the client has queued, the 413 (or 401) comes and the server
    then closes the connection: no task is left waiting on a body nobody reads."""
    with _server(backend) as server:
        port = server.port
        answers = []
        for headers in (AUTH, b""):
            with _connect(port) as conn:
                conn.sendall(HEAD % (b"/v1/completions", headers
                                     + b"transfer-encoding: chunked\r\n") + CHUNK * 200)
                answers.append(_read_all(conn))
    assert [_status(a) for a in answers] == [413, 401]
    for answer in answers:
        body = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in server.err, server.err[-3000:]
