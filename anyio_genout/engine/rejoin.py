"""Engines that come back: the handshake socket after start-up (docs/reliability.md).

As handshake owner the client keeps its handshake ROUTER open after start-up (with
``ROUTER_HANDOVER``, so a restarted engine can take over the identity of a predecessor whose
connection is still open) and :class:`Rejoins` answers on it. Bootstrapped, a registration
on the input socket is the whole handshake again.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Final

import anyio
import attrs
import zmq

from ..errors import EngineDeadError, GenoutError, TransportError
from ..protocol import (
    EngineCoreReadyResponse,
    EngineStatus,
    HandshakeAddresses,
    check_version,
    decode_ready_response,
    decode_status,
    encode_init,
    engine_identity,
)
from ..transport import ZmqSocket
from .config import EngineCoreClientConfig
from .handshake import MAX_JUNK_LOGGED, BoundSockets, JunkLog
from .reports import HealthReports

__all__ = ["HELLO_WAITS_FOR_DEATH", "Rejoins", "answer_restarted_engines"]

logger = logging.getLogger("anyio_genout.engine")

#: Seconds a restarted engine's HELLO that came while its rank was still up waits for that
#: rank to be found down: an engine restarted at once (a supervisor) dials before the
#: client has seen its predecessor die (the disconnect grace, a liveness check). It is
#: answered then; past this (a duplicate of an engine that lives on), never.
HELLO_WAITS_FOR_DEATH: Final = 60.0


@attrs.define
class _Rejoining:
    """A restarted engine between its HELLO and its rejoining."""

    registration: EngineCoreReadyResponse | None = None
    ready: bool = False


class Rejoins:
    """Engines that come back after start-up (package-internal; docs/reliability.md).

    As handshake owner, the client keeps its handshake ROUTER open and answers on: a HELLO
    from an engine of a known rank that is down gets INIT with the same addresses; its
    registration on the input socket (handed over by the input drain,
    :meth:`on_input`) and its READY (either order) make it rejoin (reported, and judged by
    the client's health). A HELLO
    from a rank that is up, or outside ``engine_ranks``, or to a client that failed as a
    whole (:meth:`_refusal` says why), is refused with a log line and no INIT (elastic
    growth is not supported). Junk is logged and ignored, as at start-up.
    Bootstrapped, an engine that registers on the input socket while it is down rejoins at
    once. Never raises out of :meth:`run` but on cancellation; the handshake socket's
    closing ends it.
    """

    def __init__(self, config: EngineCoreClientConfig, sockets: BoundSockets,
                 live: Collection[int], reports: HealthReports) -> None:
        """``live``: the ranks of the engines up (the client's set, kept current by it);
        an engine that completes its handshake again is reported to ``reports``
        (:meth:`~.reports.HealthReports.rejoin`), which decides whether it is back."""
        self._config = config
        self._handshake = sockets.handshake
        self._input = sockets.input
        self._init = encode_init(HandshakeAddresses([sockets.input_address],
                                                    [sockets.output_address]))
        self._ranks = {engine_identity(rank): rank for rank in config.engine_ranks}
        self._live = live
        self._reports = reports
        self._pending: dict[int, _Rejoining] = {}
        #: By rank: the identity of a HELLO that came while the rank was up, and when (see
        #: HELLO_WAITS_FOR_DEATH).
        self._waiting: dict[int, tuple[bytes, float]] = {}
        self._ignore = JunkLog(" after start-up", "handshake socket").ignore
        #: HELLOs (bootstrapped: registrations) refused, and engines that rejoined.
        self.refused = 0
        self.rejoined = 0
        self.engines_down(False)  # the input socket's handover, from now on

    def _refusal(self, rank: int) -> str | None:
        """Why a restarted engine ``rank`` cannot rejoin now (its HELLO or registration is
        refused), or None if it may."""
        error = self._reports.error
        if error is not None:
            return (f"the client failed as a whole ({error}), and a failed client "
                    f"takes no engine back (restart the front end; with "
                    f"last_engine_death='wait' the last engine's death does not fail it)")
        if rank in self._live:
            return f"engine {rank} is up"
        return None

    def _wait_for_death(self, rank: int, identity: bytes) -> bool:
        """Keep the HELLO of engine ``rank`` (``identity``), which is up, until it is found
        down (:meth:`engine_down`); False if the client failed."""
        if self._reports.error is not None or rank not in self._live:
            return False
        self._waiting[rank] = (identity, anyio.current_time())
        logger.warning("engine %d said HELLO while it is up: a restart that came before its "
                       "death was found, or a duplicate; it is answered if engine %d is "
                       "found down within %g s", rank, rank, HELLO_WAITS_FOR_DEATH)
        return True

    def engine_down(self, rank: int) -> None:
        """Engine ``rank`` was found down: a new input connection may take over its
        identity, and a HELLO that came from it while it was up, not too long ago, is
        answered now."""
        self.engines_down(True)
        waiting = self._waiting.pop(rank, None)
        if waiting is None or self._handshake is None:
            return
        identity, since = waiting
        if anyio.current_time() - since > HELLO_WAITS_FOR_DEATH:
            return
        self._pending[rank] = _Rejoining()
        logger.info("engine %d is down: answering the HELLO it said while it was up with "
                    "INIT", rank)
        try:
            self._handshake.send_nowait([identity, self._init])
        except anyio.ClosedResourceError:  # the client is closing
            self._pending.pop(rank, None)

    def engines_down(self, down: bool) -> None:
        """Whether an engine is down: only then may a new input connection take over an
        engine's identity (``ROUTER_HANDOVER``), for the restarted engine whose hung
        predecessor may still hold it (bootstrapped: always, see :meth:`on_input`)."""
        try:
            handover = down or self._handshake is None  # bootstrapped: always
            self._input.raw.setsockopt(zmq.ROUTER_HANDOVER, 1 if handover else 0)
        except zmq.ZMQError:  # closed meanwhile
            pass
        if not down:
            self._pending.clear()

    async def run(self) -> None:
        """The handshake socket's reader after start-up, until the socket closes."""
        sock = self._handshake
        if sock is None:
            return
        try:
            while True:  # receive() checkpoints: a flood of junk cannot starve the loop
                self._on_handshake(sock, await sock.receive())
        except anyio.ClosedResourceError:
            return
        except TransportError as exc:
            logger.warning("the handshake socket failed; restarted engines cannot rejoin: "
                           "%s", exc)

    def _on_handshake(self, sock: ZmqSocket, frames: list[zmq.Frame]) -> None:
        identity = bytes(frames[0].buffer)
        rank = self._ranks.get(identity)
        if len(frames) != 2:
            self._ignore(identity, "handshake", f"{len(frames)} frames")
            return
        try:
            message = decode_status(bytes(frames[1].buffer))
        except GenoutError as exc:
            self._ignore(identity, "handshake", str(exc))
            return
        if message.status is EngineStatus.HELLO:
            if rank is None:
                self.refused += 1
                logger.warning(
                    "refusing a HELLO from an engine with identity %r: its rank is not one "
                    "of this client's (%s; elastic growth is not supported), no INIT sent",
                    identity[:16], _ranks(self._config.engine_ranks))
            elif (why := self._refusal(rank)) is not None:
                if self._wait_for_death(rank, identity):
                    return
                self.refused += 1
                logger.warning("refusing a HELLO from engine %d: %s; no INIT sent", rank, why)
            else:
                self._pending[rank] = _Rejoining()
                logger.info("engine %d said HELLO again (local=%s, headless=%s): sent INIT, "
                            "waiting for it to register and say READY", rank, message.local,
                            message.headless)
                sock.send_nowait([identity, self._init])
            return
        pending = self._pending.get(rank) if rank is not None else None
        if pending is None or pending.ready:
            self._ignore(identity, "handshake", "READY without a HELLO")
            return
        pending.ready = True
        assert rank is not None
        self._complete(rank, pending)

    def on_input(self, frames: list[zmq.Frame]) -> bool:
        """Whether ``frames``, received on the input socket after start-up, were an engine's
        registration (taken; else the drain discards them as junk)."""
        if len(frames) != 2:
            return False
        rank = self._ranks.get(bytes(frames[0].buffer))
        if rank is None:
            return False
        if self._handshake is None and rank in self._live and self._reports.error is None:
            # An engine registers once, as it starts (an engine that only reconnects does
            # not): this is a restart whose predecessor's death the watchers have not found
            # yet, and the new connection, taking over the identity (handover is always on
            # here), would have answered their probe in the old engine's place.
            self._reports.fail_engines([rank], EngineDeadError(
                f"engine {rank} registered again on the input socket: it restarted, so "
                f"the engine it replaces is gone", ranks=[rank]))
        why = self._refusal(rank)
        if why is not None:
            if self._handshake is not None:
                return False  # its HELLO was refused, and said why
            self.refused += 1
            logger.warning("ignoring a registration from engine %d on the input socket: %s",
                           rank, why)
            return True
        pending = self._pending.get(rank)
        if self._handshake is not None and (pending is None or pending.registration):
            return False  # no HELLO first (or registered twice): not a rejoin
        try:
            response = decode_ready_response(bytes(frames[1].buffer))
        except GenoutError as exc:
            logger.warning("engine %d: undecodable registration on the input socket, "
                           "ignored: %s", rank, exc)
            self._pending.pop(rank, None)
            return True
        if pending is None:  # bootstrapped: the registration is the whole handshake
            pending = _Rejoining(ready=True)
        pending.registration = response
        self._pending[rank] = pending
        logger.info("engine %d registered again: vLLM %s, max_model_len %d", rank,
                    response.vllm_version, response.max_model_len)
        self._complete(rank, pending)
        return True

    def _complete(self, rank: int, pending: _Rejoining) -> None:
        response = pending.registration
        if response is None or not pending.ready:
            return
        del self._pending[rank]
        why: str | None = None
        if self._config.check_version:
            try:
                check_version(response.vllm_version)
            except GenoutError as exc:
                why = str(exc)
        if why is None:
            why = self._reports.rejoin(rank, response)
        if why is not None:
            self.refused += 1
            logger.error("engine %d came back but is refused and stays down: %s", rank, why)
            return
        self.rejoined += 1


async def answer_restarted_engines(config: EngineCoreClientConfig, sock: ZmqSocket,
                                   init: bytes) -> None:
    """The handshake owner for front ends in other processes, after start-up
    (``serve_handshake``'s ``after_start``): answer every HELLO from an engine of
    ``config.engine_ranks`` with ``init`` (every front end's pair). It cannot know whether
    that rank is down in each front end; each one decides, as a bootstrapped client, when
    the engine registers on its input socket (taken if that rank is down there, else
    refused with a log line). A rank outside them is refused; junk is logged and ignored.
    Runs until cancelled or the socket closes; never raises otherwise."""
    ranks = {engine_identity(rank): rank for rank in config.engine_ranks}
    hellos = dict.fromkeys(config.engine_ranks, 0)
    junk = JunkLog(" after start-up", "handshake socket")

    def ignore(identity: bytes, why: str) -> None:
        junk.ignore(identity, "handshake", why)

    try:
        while True:  # receive() checkpoints: a flood of junk cannot starve the loop
            frames = await sock.receive()
            identity = bytes(frames[0].buffer)
            rank = ranks.get(identity)
            if len(frames) != 2:
                ignore(identity, f"{len(frames)} frames")
                continue
            try:
                message = decode_status(bytes(frames[1].buffer))
            except GenoutError as exc:
                ignore(identity, str(exc))
                continue
            if rank is None:
                ignore(identity, f"{message.status.value} from a rank not one of "
                                 f"{_ranks(config.engine_ranks)} (elastic growth is not "
                                 f"supported), no INIT sent")
            elif message.status is EngineStatus.HELLO:
                hellos[rank] += 1
                # Bounded: an engine that every front end refuses may dial again at once.
                if hellos[rank] <= MAX_JUNK_LOGGED or not hellos[rank] % 1000:
                    logger.warning("engine %d said HELLO again (a restarted engine; %d so "
                                   "far): sent INIT naming every front end's sockets; each "
                                   "takes it back if it has the rank down", rank,
                                   hellos[rank])
                sock.send_nowait([identity, init])
            else:
                logger.info("engine %d is READY again", rank)
    except anyio.ClosedResourceError:
        return
    except TransportError as exc:
        logger.warning("the handshake socket failed; restarted engines cannot rejoin: %s",
                       exc)


def _ranks(ranks: range) -> str:
    return f"ranks {ranks.start}..{ranks.stop - 1}" if len(ranks) > 1 else f"rank {ranks.start}"
