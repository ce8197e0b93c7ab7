"""The builtin HTTP/1.1 server (``anyio_genout.server.http1``) at the protocol level: a small
ASGI app behind it on a real port, and raw sockets in front, read back with h11 (a strict
client-side parser: a framing mistake of ours fails it). Every test runs on asyncio and
trio. The app's own routes behind this server are the rest of tests/server on trio."""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyio_genout.server.http1 import Http1Server

pytestmark = pytest.mark.anyio

Message = dict[str, Any]


class App:
    """Routes by path: ``/echo`` (reads the body, answers what it saw as JSON), ``/stream``
    (``?n`` chunks), ``/early`` (413 without reading the body), ``/fail`` and ``/fail-late``
    (raise before and after starting), ``/none`` (returns without answering), ``/watch``
    (one chunk, then waits for ``http.disconnect``), ``/slow`` (answers after ``?s``)."""

    def __init__(self) -> None:
        self.disconnected = anyio.Event()
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        path = scope["path"]
        query = dict(part.split("=") for part in scope["query_string"].decode().split("&")
                     if "=" in part)
        if path.startswith("/echo"):
            body = b""
            while True:
                message = await receive()
                assert message["type"] == "http.request", message
                body += message["body"]
                if not message["more_body"]:
                    break
            data = json.dumps({"method": scope["method"], "path": scope["path"],
                               "raw_path": scope["raw_path"].decode(),
                               "query": scope["query_string"].decode(),
                               "root_path": scope["root_path"], "body": len(body),
                               "version": scope["http_version"]}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"%d" % len(data))]})
            await send({"type": "http.response.body", "body": data})
        elif path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(int(query.get("n", "3"))):
                await send({"type": "http.response.body", "body": b"chunk%d;" % i,
                            "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/early":
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-length", b"4")]})
            await send({"type": "http.response.body", "body": b"big!"})
        elif path == "/fail":
            raise RuntimeError("the app failed")
        elif path == "/fail-late":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"partial", "more_body": True})
            raise RuntimeError("the app failed late")
        elif path == "/watch":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
        elif path == "/slow":
            await anyio.sleep(float(query.get("s", "0.3")))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"4")]})
            await send({"type": "http.response.body", "body": b"done"})


@asynccontextmanager
async def running(app: App, **options: Any) -> AsyncIterator[tuple[int, Http1Server,
                                                                   anyio.Event]]:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = Http1Server(sock, keep_alive_timeout=options.pop("keep_alive_timeout", 2.0),
                         read_timeout=options.pop("read_timeout", None),
                         max_head_bytes=options.pop("max_head_bytes", 16 * 1024), **options)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, app, stop)
        try:
            yield port, server, stop
        finally:
            stop.set()


class Client:
    """One raw connection, its answers read with h11 (a fresh h11 connection per answer,
    fed what the previous one read past its answer)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.leftover = b""
        self.eof = False

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def answer(self, method: str = "GET") -> tuple[h11.Response, bytes]:
        """The next whole answer (5 s at most); raises h11's errors on bad framing."""
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        parser.send(h11.EndOfMessage())
        if self.leftover:
            parser.receive_data(self.leftover)
        if self.eof:  # b"" is h11's end of stream
            parser.receive_data(b"")
        response: h11.Response | None = None
        body = b""
        with anyio.fail_after(5):
            while True:
                event = parser.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = await self.stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        data = b""
                        self.eof = True
                    parser.receive_data(data)
                    continue
                if isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    assert response is not None
                    self.leftover = parser.trailing_data[0]
                    return response, body
                elif isinstance(event, h11.InformationalResponse):
                    continue
                else:
                    raise AssertionError(f"unexpected {event!r}")

    async def closed(self) -> bool:
        """Whether the server closes the connection within 3 s (after all it answered)."""
        with anyio.move_on_after(3):
            try:
                while await self.stream.receive():
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
            return True
        return False


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[Client]:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        yield Client(stream)


def get(path: str, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"GET {path} HTTP/{version}", "host: x", *headers, "", ""]
    return "\r\n".join(lines).encode()


def post(path: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: x", f"content-length: {len(body)}", *headers,
             "", ""]
    return "\r\n".join(lines).encode() + body


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    app = App()
    async with running(app) as (port, _, _), connect(port) as client:
        await client.send(get("/echo?a=1") + post("/echo", b"x" * 10) + get("/stream?n=4"))
        answers = []
        for _ in range(3):
            answers.append(await client.answer())
        await client.send(get("/echo?again"))
        again = await client.answer()
    assert [r.status_code for r, _ in answers] == [200, 200, 200]
    assert json.loads(answers[0][1])["query"] == "a=1"
    assert json.loads(answers[1][1])["body"] == 10
    assert answers[2][1] == b"chunk0;chunk1;chunk2;chunk3;"
    assert (dict(answers[2][0].headers)[b"transfer-encoding"]) == b"chunked"
    assert json.loads(again[1])["query"] == "again"


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=12))
async def test_requests_split_anywhere_are_read_the_same(cuts: list[int]) -> None:
    """Pipelined requests (a chunked body among them) written in pieces cut anywhere."""
    chunked = (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n3\r\nabc\r\n0\r\n\r\n")
    data = get("/echo?first") + chunked + post("/echo%20x", b"y" * 37) + get("/stream?n=2")
    app = App()
    async with running(app) as (port, _, _), connect(port) as client:
        offset = 0
        for cut in sorted(set(cuts)):
            if offset < cut < len(data):
                await client.send(data[offset:cut])
                offset = cut
                await anyio.sleep(0.001)  # let the server read each piece alone
        await client.send(data[offset:])
        answers = []
        for _ in range(4):
            answers.append(await client.answer())
    seen = [json.loads(body) for _, body in answers[:3]]
    assert [s["body"] for s in seen] == [0, 8, 37]
    assert seen[2]["path"] == "/echo x" and seen[2]["raw_path"] == "/echo%20x"
    assert answers[3][1] == b"chunk0;chunk1;"


async def test_a_large_body_arrives_whole_through_the_backpressure() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: the reader waits for the app past 256 KiB
    async with running(App()) as (port, _, _), connect(port) as client:
        await client.send(post("/echo", body))
        response, answer = await client.answer()
    assert response.status_code == 200 and json.loads(answer)["body"] == len(body)


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    async with running(App()) as (port, _, _), connect(port) as client:
        await client.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                          b"expect: 100-continue\r\n\r\n")
        with anyio.fail_after(3):
            interim = await client.stream.receive()
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), interim
        await client.send(b"hello")
        client.leftover = interim[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
        response, body = await client.answer()
    assert response.status_code == 200 and json.loads(body)["body"] == 5


async def test_head_gets_the_head_alone_and_http_1_0_a_closed_connection() -> None:
    async with running(App()) as (port, _, _):
        async with connect(port) as client:
            await client.send(b"HEAD /stream HTTP/1.1\r\nhost: x\r\n\r\n" + get("/echo"))
            head = await client.stream.receive()
            # no body (no chunks) after the head of a HEAD answer, then the next answer
            while head.count(b"HTTP/1.1 200") < 2 or not head.endswith(b"}"):
                head += await client.stream.receive()
        assert b"chunk" not in head, head
        async with connect(port) as client:
            await client.send(get("/stream", version="1.0"))
            data = b""
            with anyio.fail_after(3):
                try:
                    while chunk := await client.stream.receive():
                        data += chunk
                except anyio.EndOfStream:
                    pass
        head, _, body = data.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head.lower() and b"connection: close" in head
        assert body == b"chunk0;chunk1;chunk2;"


async def test_connection_close_is_honoured() -> None:
    async with running(App()) as (port, _, _), connect(port) as client:
        await client.send(get("/echo", "connection: close"))
        response, _ = await client.answer()
        assert (b"connection", b"close") in response.headers
        assert await client.closed()


async def test_an_early_answer_reaches_a_client_still_sending_its_body() -> None:
    async with running(App()) as (port, _, _), connect(port) as client:
        await client.send(b"POST /early HTTP/1.1\r\nhost: x\r\ncontent-length: 4000000\r\n\r\n")
        for _ in range(20):  # the body keeps coming after the answer was sent
            await client.send(b"z" * 65536)
        response, body = await client.answer()
        assert response.status_code == 413 and body == b"big!"
        assert (b"connection", b"close") in response.headers
        assert await client.closed()


async def test_an_app_failure_is_500_or_a_cut_and_serving_goes_on() -> None:
    async with running(App()) as (port, _, _):
        for path in ("/fail", "/none"):
            async with connect(port) as client:
                await client.send(get(path))
                response, _ = await client.answer()
                assert response.status_code == 500
                assert await client.closed()
        async with connect(port) as client:
            await client.send(get("/fail-late"))
            with pytest.raises(h11.RemoteProtocolError):  # the chunked body never ends
                await client.answer()
        async with connect(port) as client:
            await client.send(get("/echo"))
            assert (await client.answer())[0].status_code == 200


async def test_the_500_to_a_head_request_has_no_body() -> None:
    """What the server answers by itself to a HEAD is a head alone: a body after it would
    be read as the next answer by a client that keeps the connection."""
    async with running(App()) as (port, _, _), connect(port) as client:
        await client.send(b"HEAD /fail HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        with anyio.fail_after(5):
            try:
                while chunk := await client.stream.receive():
                    data += chunk
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 500 ")
        assert b"content-length: 21" in head.lower()  # the length a GET's body would have
        assert rest == b""


@pytest.mark.parametrize("request_bytes", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
    b"GET /\xff HTTP/1.1\r\nhost: x\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
])
async def test_a_malformed_request_is_400_and_closed(request_bytes: bytes) -> None:
    async with running(App()) as (port, _, _), connect(port) as client:
        await client.send(request_bytes)
        response, _ = await client.answer()
        assert response.status_code == 400
        assert await client.closed()


async def test_a_head_too_large_is_431_whether_whole_or_still_coming() -> None:
    async with running(App(), max_head_bytes=1024) as (port, _, _):
        async with connect(port) as client:
            await client.send(get("/echo", *(f"x-h{i}: {'v' * 50}" for i in range(40))))
            assert (await client.answer())[0].status_code == 431
        async with connect(port) as client:
            await client.send(b"GET /echo HTTP/1.1\r\nx-endless: ")
            for _ in range(4):  # one header that never ends, read in pieces
                await client.send(b"v" * 1000)
                await anyio.sleep(0.01)
            assert (await client.answer())[0].status_code == 431
            assert await client.closed()


async def test_slow_and_idle_heads_are_closed_after_the_keep_alive_timeout() -> None:
    async with running(App(), keep_alive_timeout=0.3) as (port, _, _):
        async with connect(port) as client:  # never sends anything
            assert await client.closed()
        async with connect(port) as client:  # a head trickling in
            with anyio.move_on_after(3):
                try:
                    for byte in b"GET /echo HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 60:
                        await client.send(bytes([byte]))
                        await anyio.sleep(0.05)
                except anyio.BrokenResourceError:
                    pass  # closed while it trickled: what is asserted below
                else:
                    raise AssertionError("a head trickling for 3 s was not cut")
            assert await client.closed()
        async with connect(port) as client:  # idle after an answer
            await client.send(get("/echo"))
            await client.answer()
            assert await client.closed()


async def test_a_client_that_goes_is_seen_as_http_disconnect() -> None:
    app = App()
    async with running(app) as (port, _, _):
        async with connect(port) as client:
            await client.send(get("/watch"))
            seen = b""
            with anyio.fail_after(3):
                while b"first" not in seen:
                    seen += await client.stream.receive()
        with anyio.fail_after(3):
            await app.disconnected.wait()


async def test_read_timeout_closes_a_silent_connection_even_while_it_streams() -> None:
    app = App()
    async with running(app, read_timeout=0.3) as (port, _, _), connect(port) as client:
        await client.send(get("/watch"))
        with anyio.fail_after(3):
            await app.disconnected.wait()
        assert await client.closed()


async def test_a_stop_drains_closes_idle_connections_and_refuses_new_ones() -> None:
    app = App()
    async with running(app) as (port, server, stop):
        server.graceful_timeout = 5.0
        async with connect(port) as idle, connect(port) as busy:
            await idle.send(get("/echo"))
            await idle.answer()
            await busy.send(get("/slow?s=0.4"))
            await anyio.sleep(0.1)
            stop.set()
            assert await idle.closed()
            response, body = await busy.answer()
            assert response.status_code == 200 and body == b"done"
            assert (b"connection", b"close") in response.headers
            assert await busy.closed()
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", port)


async def test_a_stop_cancels_what_outlives_the_graceful_timeout() -> None:
    app = App()
    async with running(app) as (port, server, stop), connect(port) as client:
        server.graceful_timeout = 0.2
        await client.send(get("/slow?s=30"))
        await anyio.sleep(0.1)
        with anyio.fail_after(3):
            stop.set()
            assert await client.closed()


async def test_the_scope_names_path_query_root_path_and_version() -> None:
    app = App()
    async with running(app, root_path="/api") as (port, _, _), connect(port) as client:
        await client.send(get("/echo%2Fa%20b?x=%20", version="1.1"))
        _, body = await client.answer()
    seen = json.loads(body)
    assert seen == {"method": "GET", "path": "/echo/a b", "raw_path": "/echo%2Fa%20b",
                    "query": "x=%20", "root_path": "/api", "body": 0, "version": "1.1"}
    assert app.scopes[0]["client"][0] == "127.0.0.1"
    assert app.scopes[0]["server"] == ("127.0.0.1", port)


async def test_running_out_of_descriptors_pauses_accepting_and_serving_goes_on() -> None:
    """A connection flood past the process's descriptor limit: accept fails (EMFILE), and
    once the flood closes, new connections are served (trio's listener raised it as
    BrokenResourceError, which once ended the whole server)."""
    app = App()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with running(app) as (port, _, _):
        flood = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (len(os.listdir("/proc/self/fd")) + 40, hard))
            # The server's side of each connection takes a descriptor too: it runs out
            # first, while the kernel still completes connections into the backlog.
            for _ in range(60):
                try:
                    flood.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                except OSError:
                    break
            await anyio.sleep(0.5)  # the accept loop meets EMFILE meanwhile
        finally:
            for conn in flood:
                conn.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        with anyio.fail_after(5):
            async with connect(port) as client:
                await client.send(get("/echo"))
                assert (await client.answer())[0].status_code == 200


async def test_a_client_reset_before_it_is_served_does_not_end_the_server() -> None:
    async with running(App()) as (port, _, _):
        for _ in range(20):  # reset at once: its address is gone before it is served
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        await anyio.sleep(0.2)
        async with connect(port) as client:
            await client.send(get("/echo"))
            assert (await client.answer())[0].status_code == 200


@pytest.mark.parametrize("after", [
    get("/echo") * 9,  # parsing waits for the app: the client going must still be seen
    b"\x00garbage",  # refused: nothing more is parsed
    b"",
])
async def test_a_client_gone_is_seen_whatever_came_after_its_request(after: bytes) -> None:
    app = App()
    async with running(app) as (port, _, _):
        async with connect(port) as client:
            await client.send(get("/watch") + after)
            seen = b""
            with anyio.fail_after(3):
                while b"first" not in seen:
                    seen += await client.stream.receive()
        with anyio.fail_after(3):
            await app.disconnected.wait()


async def test_trailers_do_not_join_the_request_headers() -> None:
    app = App()
    async with running(app) as (port, _, _), connect(port) as client:
        await client.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                          b"2\r\nhi\r\n0\r\nauthorization: Bearer evil\r\n\r\n")
        response, body = await client.answer()
    assert response.status_code == 200 and json.loads(body)["body"] == 2
    assert b"authorization" not in dict(app.scopes[0]["headers"])


async def test_a_head_under_the_limit_is_served_however_it_is_cut() -> None:
    head = get("/echo", *(f"x-h{i}: {'v' * 100}" for i in range(100)))  # about 11 KB
    async with running(App()) as (port, _, _), connect(port) as client:
        for i in range(0, len(head), 300):
            await client.send(head[i:i + 300])
            await anyio.sleep(0.002)
        assert (await client.answer())[0].status_code == 200


async def test_read_timeout_ends_a_response_to_a_client_that_does_not_read() -> None:
    app = App()
    async with running(app, read_timeout=0.5) as (port, _, _):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        try:
            sock.sendall(get("/stream?n=1000000"))  # never read
            await anyio.sleep(1.5)  # its send window fills; then 0.5 s of silence
            # the server gave up on it: its side is closed (reading shows the end)
            sock.settimeout(5)  # a stream a million chunks long would not end in 5 s
            try:
                while sock.recv(1 << 20):
                    pass
            except ConnectionResetError:
                pass
        finally:
            sock.close()
