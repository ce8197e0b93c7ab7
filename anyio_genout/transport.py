"""ZeroMQ sockets driven by AnyIO: the thin I/O shell under the protocol core.

No threads and no ``zmq.asyncio``: each :class:`ZmqSocket` waits for the socket's file
descriptor to be readable (:class:`~anyio_genout.readiness.FdWaiter`: registered once on
asyncio and uvloop, :func:`anyio.wait_readable` on trio). ZeroMQ's descriptor only ever
signals "something changed": ``ZMQ_EVENTS`` is checked before every wait
(:meth:`ZmqSocket.readable`), and a socket is drained with ``NOBLOCK`` receives until it
reports no message queued.

Rules this module keeps:

* exactly one task waits on a socket's descriptor (receivers are serialised by the caller's
  design: one reader task per socket; senders share a lock);
* closing marks the socket closed, wakes any waiter with :class:`anyio.ClosedResourceError`,
  then closes (with no linger unless asked, so nothing waits on a dead peer);
* every ``zmq.ZMQError`` becomes :class:`~anyio_genout.errors.OperationalError`-family errors
  or :class:`anyio.ClosedResourceError`, never leaks.
"""

from __future__ import annotations

import collections
import random
import socket as _socket
import struct
from collections.abc import Sequence
from typing import Any, Final, cast

import anyio
import anyio.lowlevel
import zmq

from .errors import TransportError
from .readiness import FdWaiter

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "MonitorEvent",
    "TransportError",
    "ZmqSocket",
    "bind_address",
    "new_context",
]

#: Default bound on one received message (``ZMQ_MAXMSGSIZE``): a hostile peer cannot make the
#: client allocate more than this per frame.
DEFAULT_MAX_MESSAGE_SIZE: Final = 256 * 1024 * 1024
Frames = Sequence[bytes | memoryview | zmq.Frame]
#: Parts at least this large are sent without a copy (pyzmq copies smaller ones anyway).
_ZERO_COPY_THRESHOLD: Final = 65536

# The hot paths call pyzmq's compiled socket methods directly. The pure-Python wrappers
# (``send_multipart``, ``recv_multipart`` and the ``zmq.Flag`` arithmetic they do per part)
# cost more than the sends and receives themselves: 3.0 against 0.6 us for a three-part
# send, 1.4 against 0.7 us for a one-part receive (docs/performance.md).
_raw_send: Final[Any] = zmq.backend.Socket.send
_raw_recv: Final[Any] = zmq.backend.Socket.recv
_raw_get: Final[Any] = zmq.backend.Socket.get
_NOBLOCK: Final = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK: Final = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)


class MonitorEvent:
    """One ``zmq_socket_monitor`` event: ``event`` (a ``zmq.EVENT_*`` bit), ``value`` (the
    connection's file descriptor for ACCEPTED/DISCONNECTED) and the socket's ``endpoint``."""

    __slots__ = ("endpoint", "event", "value")

    def __init__(self, event: int, value: int, endpoint: str) -> None:
        self.event = event
        self.value = value
        self.endpoint = endpoint

    @classmethod
    def parse(cls, frames: Sequence[zmq.Frame]) -> MonitorEvent | None:
        """Decode a monitor message (None if it is not one)."""
        if len(frames) != 2 or len(frames[0].buffer) != 6:
            return None
        event, value = struct.unpack("=Hi", frames[0].buffer)
        return cls(event, value, bytes(frames[1].buffer).decode(errors="replace"))


def new_context() -> zmq.Context[Any]:
    """A private ZeroMQ context (never the global instance, so closing it is ours to do)."""
    return zmq.Context(io_threads=1)


class ZmqSocket:
    """One ZeroMQ socket used from one event loop.

    ``receive`` must be called by a single task at a time; ``send`` may be called by many
    (they queue on a lock). :meth:`aclose` may be called from any task, also while another
    task waits in ``receive``: the waiter gets :class:`anyio.ClosedResourceError`.
    """

    def __init__(self, context: zmq.Context[Any], kind: int, *, identity: bytes | None = None,
                 max_message_size: int | None = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        try:
            sock = context.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            if max_message_size is not None:
                sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot create ZeroMQ socket: {exc}") from None
        self._sock = sock
        self._fd: int = sock.getsockopt(zmq.FD)
        self._waiter: FdWaiter | None = None  # made by the first wait, in its event loop
        self._send_lock = anyio.Lock()
        self._closed = False

    @classmethod
    def _adopt(cls, sock: zmq.Socket[Any]) -> ZmqSocket:
        """Wrap a socket pyzmq created (e.g. a monitor PAIR)."""
        self = cls.__new__(cls)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            self._fd = cast(int, sock.getsockopt(zmq.FD))
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(f"cannot use ZeroMQ socket: {exc}") from None
        self._sock = sock
        self._waiter = None
        self._send_lock = anyio.Lock()
        self._closed = False
        return self

    def monitor(self, events: int) -> ZmqSocket:
        """A PAIR socket receiving this socket's ``events`` (``zmq_socket_monitor``); read
        them with :meth:`MonitorEvent.parse`. Close it before closing this socket."""
        try:
            pair = self._sock.get_monitor_socket(events)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot monitor ZeroMQ socket: {exc}") from None
        return ZmqSocket._adopt(pair)

    def set_heartbeat(self, interval: float, timeout: float) -> None:
        """Ping every peer connection each ``interval`` seconds (ZMTP PING; any libzmq peer
        answers by itself) and close a connection that receives nothing for ``timeout``
        seconds, as a socket monitor then reports. A peer that vanished without closing its
        TCP connection (host gone, network cut, process stopped) is seen as one that left.

        Set it before binding or connecting: it applies to connections made afterwards.
        Raises :class:`TransportError` if ZeroMQ refuses the options.
        """
        try:
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(interval * 1000)))
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(timeout * 1000)))
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot set ZeroMQ heartbeats: {exc}") from None

    @property
    def raw(self) -> zmq.Socket[Any]:
        """The pyzmq socket, for options; do not send or receive on it directly."""
        return self._sock  # type: ignore[no-any-return]

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, address: str, *, listener_fd: int | None = None) -> str:
        """Bind and return the resolved endpoint (``tcp://host:0`` gets its real port).

        ``listener_fd``: a listening socket already bound at ``address`` (inherited from
        another process) that ZeroMQ adopts instead of binding a new one; it owns it then.
        """
        try:
            if address.startswith("tcp://[") or _is_ipv6_literal(address):
                self._sock.setsockopt(zmq.IPV6, 1)
            if listener_fd is not None:
                self._sock.setsockopt(zmq.USE_FD, listener_fd)
            self._sock.bind(address)
            endpoint: bytes | str = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot bind {address}: {exc}") from None
        return endpoint.decode() if isinstance(endpoint, bytes) else endpoint

    def connect(self, address: str) -> None:
        try:
            if _is_ipv6_literal(address):
                self._sock.setsockopt(zmq.IPV6, 1)
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot connect to {address}: {exc}") from None

    # ------------------------------------------------------------------ receiving

    def receive_nowait(self) -> list[zmq.Frame] | None:
        """One multipart message if one is queued, else None (never blocks).

        The package's ``_nowait`` convention: None (or False for a send) only means "not
        now, wait and try again"; a socket that is closed raises
        :class:`anyio.ClosedResourceError`, so closed never looks like empty. Raises
        :class:`~anyio_genout.TransportError` if ZeroMQ fails.
        """
        if self._closed:
            raise anyio.ClosedResourceError
        sock = self._sock
        try:
            frame = _raw_recv(sock, _NOBLOCK, False, False)
            frames = [frame]
            while frame.more:  # the rest of a message is queued with its first part
                frame = _raw_recv(sock, _NOBLOCK, False, False)
                frames.append(frame)
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            if self._closed:
                raise anyio.ClosedResourceError from None
            raise TransportError(f"receive failed: {exc}") from None
        return frames

    def readable(self) -> bool:
        """Whether a message is queued (``ZMQ_EVENTS``; cheaper than a receive that finds
        nothing, which raises inside pyzmq)."""
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            return bool(_raw_get(self._sock, _EVENTS) & _POLLIN)
        except zmq.ZMQError as exc:
            if self._closed:
                raise anyio.ClosedResourceError from None
            raise TransportError(f"socket failed: {exc}") from None

    async def wait_readable(self) -> None:
        """Wait until a message may be queued (returns at once if one is known to be)."""
        while not self.readable():
            await self.wait_signalled()

    async def wait_signalled(self) -> None:
        """Wait until the socket's descriptor signals a change, which may or may not be a
        message: call after :meth:`readable` returned False, then check it again."""
        if self._closed:
            raise anyio.ClosedResourceError
        waiter = self._waiter
        if waiter is None:
            waiter = self._waiter = FdWaiter(self._fd, self._has_events)
        await waiter.wait()

    def _has_events(self) -> bool:
        """Whether a waiter has something to check: a message queued, room to send, or an
        error (True: the waiter finds out). For :class:`FdWaiter`, which must not raise."""
        try:
            return bool(_raw_get(self._sock, _EVENTS))
        except zmq.ZMQError:
            return True

    async def receive(self) -> list[zmq.Frame]:
        """Wait for and return the next multipart message."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            message = self.receive_nowait()
            if message is not None:
                await anyio.lowlevel.cancel_shielded_checkpoint()
                return message
            await self.wait_readable()

    # ------------------------------------------------------------------ sending

    def send_nowait(self, frames: Frames) -> bool:
        """Queue ``frames`` if ZeroMQ can take them now; False if it would block.

        With the unbounded high-water marks set here this only fails to send while a
        peer has not connected yet (PUSH, DEALER). ROUTER sockets drop messages addressed to
        unknown identities silently, as ZeroMQ does. Raises
        :class:`anyio.ClosedResourceError` once the socket is closed (the ``_nowait``
        convention of :meth:`receive_nowait`).
        """
        if self._closed:
            raise anyio.ClosedResourceError
        # Zero-copy sends build a zmq.Frame per part, which costs more than copying a small
        # part (a typical ADD is a few hundred bytes): copy unless a part is large.
        copy = True
        for frame in frames:
            if len(frame) >= _ZERO_COPY_THRESHOLD:
                copy = False
                break
        sock = self._sock
        last = len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                _raw_send(sock, frame, _SNDMORE_NOBLOCK if i < last else _NOBLOCK, copy, False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if self._closed:
                raise anyio.ClosedResourceError from None
            raise TransportError(f"send failed: {exc}") from None
        return True

    async def send(self, frames: Frames) -> None:
        """Send one multipart message, waiting while ZeroMQ cannot queue it."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        async with self._send_lock:
            while not self.send_nowait(frames):
                if self._closed:
                    raise anyio.ClosedResourceError
                if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                    continue
                # The FD only signals "readable" for any state change, POLLOUT included.
                with anyio.move_on_after(0.05):
                    await self.wait_signalled()
        await anyio.lowlevel.cancel_shielded_checkpoint()

    # ------------------------------------------------------------------ closing

    def close(self, linger: float = 0.0) -> None:
        """Close; wakes a task blocked in :meth:`receive`. Idempotent.

        ``linger`` (seconds) lets messages already queued leave after the close; the
        context's ``term()`` waits for them at most that long. The default drops them.
        """
        if self._closed:
            return
        self._closed = True
        if self._waiter is not None:
            self._waiter.close()  # wakes a waiting task, before the descriptor goes away
        self._sock.close(linger=int(linger * 1000))

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()


def _is_ipv6_literal(address: str) -> bool:
    return address.startswith("tcp://[")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(v) for v in fh.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


#: The port picker's own generator: a caller's seeded ``random`` (hypothesis seeds it for every
#: example) must not make every call pick the ports the previous call just closed.
_ports = random.SystemRandom()
#: The last _HANDED_OUT_KEPT ports this process handed out, in order and as a set: none
#: is handed out again, so a caller that asks for two ports before binding either (an HTTP
#: port and a handshake address) gets two (a test's server once failed to bind its
#: handshake address on its own HTTP port).
_HANDED_OUT_KEPT: Final = 1024
_handed_out: Final[collections.deque[int]] = collections.deque()
_handed_out_set: Final[set[int]] = set()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, for an address that must be known in advance
    (a handshake address that engines dial).

    It is chosen outside the kernel's ephemeral range when possible: a port picked by
    binding to port 0 lies in that range, so until it is bound again any outgoing connection
    on the machine may take it (ZeroMQ's own connections included) and the later bind fails.
    """
    low, high = _ephemeral_range()
    candidates = [p for p in (_ports.randrange(10000, 32768) for _ in range(64))
                  if not low <= p <= high and p not in _handed_out_set]
    family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
    for port in candidates:
        with _socket.socket(family) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            _handed_out.append(port)
            _handed_out_set.add(port)
            if len(_handed_out) > _HANDED_OUT_KEPT:
                _handed_out_set.discard(_handed_out.popleft())
            return port
    with _socket.socket(family) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """``tcp://host:port`` with a port from :func:`free_tcp_port`."""
    return bind_address(host, free_tcp_port(host))


def bind_address(host: str, port: int = 0) -> str:
    """A ``tcp://`` address for ``host`` (IPv6 literals bracketed) and ``port`` (0 = any)."""
    try:
        _socket.inet_pton(_socket.AF_INET6, host)
    except OSError:
        return f"tcp://{host}:{port if port else '*'}"
    return f"tcp://[{host}]:{port if port else '*'}"
