"""The handshake-mode start of the mock engine: HELLO to the front end, then its INIT.

A front end that is there answers HELLO with INIT at once, so the wait has two bounds:
``front_end_timeout`` for a front end to be listening at the handshake address at all (a
ZeroMQ connection to its handshake socket: a ZMTP handshake that succeeded, seen on a socket
monitor), and ``handshake_timeout`` for INIT. The first one turns a mock started with
``await tg.start(engine.serve)`` before its client connects (which cannot work: started
means READY was sent) into a prompt error that says so, instead of a 300 s wait.
"""

from __future__ import annotations

import anyio
import zmq

from ..errors import HandshakeTimeoutError, OperationalError
from ..protocol import (
    EngineStatus,
    HandshakeAddresses,
    StatusMessage,
    decode_init,
    encode_status,
)
from ..transport import MonitorEvent, ZmqSocket
from .config import MockEngineConfig

__all__ = ["dial_front_end"]


async def dial_front_end(hs: ZmqSocket, cfg: MockEngineConfig) -> HandshakeAddresses:
    """Connect ``hs`` (the engine's DEALER, which the caller closes) to
    ``cfg.handshake_address``, say HELLO and return the addresses of the front end's INIT.

    Raises :class:`~anyio_genout.errors.HandshakeTimeoutError` when nothing listens at the
    address within ``front_end_timeout`` (stage ``"a front end"``, a message that says how
    to start the engine) or no INIT comes within ``handshake_timeout`` (stage ``"INIT"``);
    :class:`~anyio_genout.errors.HandshakeError` or
    :class:`~anyio_genout.errors.ProtocolError` on an undecodable INIT.
    """
    assert cfg.handshake_address is not None
    watched = cfg.front_end_timeout < cfg.handshake_timeout
    # Before connecting, so the monitor cannot miss the connection's handshake.
    monitor = hs.monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED) if watched else None
    hs.connect(cfg.handshake_address)
    await hs.send([encode_status(StatusMessage(EngineStatus.HELLO, local=False,
                                               headless=True))])
    absent = anyio.Event()
    frames: list[zmq.Frame] | None = None
    try:
        with anyio.move_on_after(cfg.handshake_timeout):
            if monitor is None:
                frames = await hs.receive()
            else:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_watch, monitor, cfg, absent, tg.cancel_scope)
                    frames = await hs.receive()
                    tg.cancel_scope.cancel()
    finally:
        if monitor is not None:
            hs.raw.disable_monitor()
            monitor.close()
    if frames is not None:
        return decode_init(frames[-1].bytes)
    if absent.is_set():
        error = HandshakeTimeoutError("a front end", [cfg.rank], cfg.front_end_timeout)
        error.args = (
            f"no front end is listening at {cfg.handshake_address} after "
            f"{cfg.front_end_timeout:g} s (MockEngineConfig.front_end_timeout), so no INIT "
            f"can come; in handshake mode MockEngine.serve reports started only after READY, "
            f"which needs the client connecting (Client.connect) at the same time: start "
            f"serve with start_soon, or connect the client first (in another task)",)
        raise error
    raise HandshakeTimeoutError("INIT", [cfg.rank], cfg.handshake_timeout)


async def _watch(monitor: ZmqSocket, cfg: MockEngineConfig, absent: anyio.Event,
                 scope: anyio.CancelScope) -> None:
    """Return once a front end accepted the connection (a ZMTP handshake succeeded); after
    ``cfg.front_end_timeout`` seconds without one, set ``absent`` and cancel ``scope``."""
    with anyio.move_on_after(cfg.front_end_timeout):
        while True:
            try:
                event = MonitorEvent.parse(await monitor.receive())
            except (anyio.ClosedResourceError, OperationalError):
                return
            if event is not None and event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
    absent.set()
    scope.cancel()
