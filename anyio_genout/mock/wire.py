"""The mock engine's output side: pre-packed msgpack pieces, message assembly, sending.

Plain decode rows never go through msgpack. Such a row is three byte strings: the request's
pre-packed ``prefix`` (row header and request id), its new token ids (for one token, an
entry of :func:`token_table`) and the request's pre-packed ``mid`` (the remaining fields).
:meth:`OutputWriter.send_message` joins a client's row parts between a pre-packed message
head and the trailing fields into one ``EngineCoreOutputs`` frame. A row that needs more
(logprobs, events, prefill stats, a finish) is packed whole by the step and passed as one
part plus two empty ones.

:class:`OutputWriter` is the part of :class:`~.engine.MockEngine` that writes: it owns the
output sockets, the pre-packed pieces and the weight version every step's message carries,
sends without waiting (queueing, in order, behind a blocked socket), tracks final messages
so closing can linger until they left, and sends utility replies, finish-only messages and
``ENGINE_CORE_DEAD``. It also keeps the engine's ``errors`` and its death, which every other
part reports to it. It knows nothing of requests or steps.
"""

from __future__ import annotations

import functools
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio
import msgpack
import zmq

from ..protocol import ENGINE_CORE_DEAD
from ..transport import ZmqSocket
from .config import MockEngineConfig

__all__ = ["OutputWriter", "array_header", "pack", "pack_double", "token_table",
           "wait_any_readable"]

_DEFAULT_WEIGHT_VERSION: Final = "default"

pack: Final[Callable[[Any], bytes]] = functools.partial(msgpack.packb, use_bin_type=True)
pack_double: Final = struct.Struct(">d").pack


def array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


@functools.lru_cache(maxsize=4)
def token_table(vocab_size: int) -> tuple[bytes, ...]:
    """msgpack encoding of the one-token list ``[t]`` for every ``t < vocab_size``."""
    table = [b"\x91" + bytes((i,)) for i in range(min(vocab_size, 128))]
    table += [b"\x91\xcc" + bytes((i,)) for i in range(128, min(vocab_size, 256))]
    table += [b"\x91\xcd" + i.to_bytes(2, "big")
              for i in range(256, min(vocab_size, 1 << 16))]
    table += [b"\x91\xce" + i.to_bytes(4, "big") for i in range(1 << 16, vocab_size)]
    return tuple(table)


class OutputWriter:
    """Output sockets and messages (the writing part of :class:`~.engine.MockEngine`).

    ``row_header`` (a row's array header), ``tail_fields`` (fields 14.. of a plain row) and
    ``token_bytes`` (:func:`token_table`) are the pre-packed pieces rows are built from.
    """

    def __init__(self, config: MockEngineConfig) -> None:
        self.config = config
        self.errors: list[str] = []
        self.dead = False
        self.death_reason: str | None = None  # why it sent ENGINE_CORE_DEAD
        self._weight_version = _DEFAULT_WEIGHT_VERSION
        self._weight_version_bytes = pack(_DEFAULT_WEIGHT_VERSION)

        fields = config.output_fields
        self.row_header: Final = array_header(fields)
        self.tail_fields: Final = b"\xc0" * (fields - 14)
        self.token_bytes: Final = token_table(config.vocab_size)
        self._msg_head = b"\x99" + pack(config.rank)
        self._outputs: list[ZmqSocket] = []
        self._trackers: list[zmq.MessageTracker] = []
        self._blocked: list[tuple[ZmqSocket, list[bytes | memoryview]]] = []

    # ------------------------------------------------------------------ state

    @property
    def num_clients(self) -> int:
        """Output sockets (one per client)."""
        return len(self._outputs)

    @property
    def blocked(self) -> bool:
        """Messages wait behind a full socket: :meth:`send_blocked` must run."""
        return bool(self._blocked)

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """The version every later step's message carries."""
        self._weight_version = version
        self._weight_version_bytes = pack(version)

    def add_output(self, sock: ZmqSocket) -> None:
        """Adopt ``sock`` as the next client's output socket (closed by :meth:`close`)."""
        self._outputs.append(sock)

    def close(self) -> None:
        """Close the output sockets."""
        for sock in self._outputs:
            sock.close()

    # ------------------------------------------------------------------ messages

    def send_message(self, client: int, rows: list[bytes], stats: bytes, *,
                      weight_version: bool,
                      aux: list[bytes | memoryview] | None = None) -> None:
        """Assemble ``EngineCoreOutputs`` from row parts (three per row) and send it."""
        main = b"".join([
            self._msg_head, array_header(len(rows) // 3), *rows, stats,
            b"\xcb", pack_double(time.monotonic()), b"\xc0\xc0\xc0\xc0",
            self._weight_version_bytes if weight_version else b"\xc0",
        ])
        frames: list[bytes | memoryview] = [main]
        if aux is not None:
            frames.extend(aux[1:])
        self._send(self._outputs[client], frames)

    def send_utility(self, client: int, call_id: int, failure: str | None,
                      result: object) -> None:
        wrapped = None if failure is not None else [None, result]
        message = [self.config.rank, [], None, time.monotonic(), [call_id, failure, wrapped],
                   None, None, None, None]
        try:
            payload = pack(message)
        except (TypeError, ValueError, OverflowError) as exc:
            payload = pack([self.config.rank, [], None, time.monotonic(),
                             [call_id, f"Call to utility failed: {exc}", None],
                             None, None, None, None])
        self._send(self._outputs[client], [payload])

    def send_finish_outputs(self, client: int, requests: list[tuple[str, dict[str, str] | None]],
                             reason: int, *, tracked: bool = False,
                             error: dict[str, Any] | None = None) -> None:
        """Rows with no tokens and ``reason`` plus ``finished_requests`` (no stats);
        ``error`` is each row's error object (vLLM 0.33's 19th field; 0.32 has none)."""
        fields = self.config.output_fields
        rows: list[list[Any]] = [
            [rid, [], None, None, None, reason, None, None, None, None, trace, None, None, 0,
             None, None, None, None, error][:fields]
            for rid, trace in requests
        ]
        message = [self.config.rank, rows, None, time.monotonic(), None,
                   [rid for rid, _ in requests], None, None, None]
        frames: list[bytes | memoryview] = [pack(message)]
        if tracked:
            self._send_tracked(self._outputs[client], frames)
        else:
            self._send(self._outputs[client], frames)

    def send_to_all(self, frames: list[bytes | memoryview]) -> None:
        """Send ``frames`` on every output socket (in order behind blocked messages)."""
        for out in self._outputs:
            self._send(out, frames)

    def die(self, reason: str) -> None:
        """Send ENGINE_CORE_DEAD on every output socket; the loop then stops."""
        if self.dead:
            return
        self.dead = True
        self.death_reason = reason
        self.errors.append(reason)
        for out in self._outputs:
            self._send_tracked(out, [ENGINE_CORE_DEAD])

    # ------------------------------------------------------------------ sending

    def _send(self, sock: ZmqSocket, frames: list[bytes | memoryview]) -> None:
        if self._blocked or not sock.send_nowait(frames):
            self._blocked.append((sock, frames))  # keep order: later sends queue behind

    async def send_blocked(self) -> None:
        """Send the messages queued behind a full socket, in order."""
        blocked, self._blocked = self._blocked, []
        for sock, frames in blocked:
            await sock.send(frames)

    def _send_tracked(self, sock: ZmqSocket, frames: list[bytes | memoryview]) -> None:
        """Send now with a tracker, so closing can wait until the bytes left (linger)."""
        if self._blocked or sock.closed:
            self._send(sock, frames)
            return
        raw = sock.raw
        threshold = raw.copy_threshold
        raw.copy_threshold = 0  # a copied frame's tracker is done at once: track the real one
        try:
            tracker = raw.send_multipart(frames, zmq.NOBLOCK, copy=False, track=True)
        except zmq.ZMQError as exc:
            self.errors.append(f"could not send final message: {exc}")
            return
        finally:
            raw.copy_threshold = threshold
        if tracker is not None:
            self._trackers.append(tracker)

    async def flush_tracked(self) -> None:
        """Wait (at most ``linger`` seconds) until tracked final messages were sent."""
        with anyio.move_on_after(self.config.linger):
            for tracker in self._trackers:
                while True:
                    if tracker.done:
                        break
                    await anyio.sleep(0.002)
        self._trackers.clear()


async def wait_any_readable(sockets: Sequence[ZmqSocket]) -> None:
    """Wait until one of ``sockets`` (an engine's input sockets, one per front end) may have
    a message queued."""
    if len(sockets) == 1:
        await sockets[0].wait_readable()
        return

    async def one(sock: ZmqSocket, scope: anyio.CancelScope) -> None:
        await sock.wait_readable()
        scope.cancel()

    async with anyio.create_task_group() as tg:
        for sock in sockets:
            tg.start_soon(one, sock, tg.cancel_scope)
