"""Data-parallel request waves (vLLM's MoE lockstep), sans-IO: what to stamp, what to send.

The engines of a data-parallel MoE group step together (an engine with nothing to do runs
dummy batches) and pause together when none has work; a *wave* is one running period, and
its number counts the pauses. An engine paused in wave ``w`` that gets a request starts
stepping alone and blocks in the group's all-reduce until its peers join, so whoever sends
a request while the group is paused must wake the others with ``START_DP_WAVE``.

:class:`WaveState` is what vLLM's DP coordinator and front end keep (vLLM 0.32's
``DPCoordinator`` plus ``DPAsyncMPClient``, and the Rust client's in-process coordinator):

* every request carries ``current_wave``; the first request while the engines are paused
  also starts the wave: ``START_DP_WAVE [current_wave, exclude=target]`` to the engines
  (the target needs no wake-up: the request is one), and the state is *running* at once,
  so concurrent requests coalesce into one wake-up (as ``DPAsyncMPClient`` sets
  ``engines_running`` when it sends ``FIRST_REQ``; 0.32's coordinator itself waits for
  rank 0's ``start_wave`` before it publishes *running*);
* ``wave_complete = w`` from an engine: if ``w >= current_wave`` the wave is over
  (``current_wave = w + 1``, paused); a repeat (every engine sends it when no coordinator
  runs) is ignored;
* ``start_wave = w`` from an engine (it got a request of an older wave while paused): if
  ``w > current_wave``, or ``w == current_wave`` while paused, the state follows (wave
  ``w``, running) and ``START_DP_WAVE [w, exclude=sender]`` goes to the engines.

One rule more than vLLM's: engines started without a coordinator never send
``start_wave`` (and every one of them sends ``wave_complete``), so a request stamped for the
wave that just completed (sent while the state still said running) could sit on a paused
engine that blocks in the collective forever. An engine's ``wave_complete`` follows its own
earlier outputs on its socket, so when it reports the wave complete while requests this
client sent it are unfinished, one of them arrived after its pause:
:meth:`WaveState.wave_complete` then starts the next wave for every engine at once.

``START_DP_WAVE`` travels as ``[0x02, msgpack([wave, exclude_engine_index | nil])]``; vLLM's
coordinator publishes it on its XPUB, which an engine's input thread polls together with
its input socket and decodes the same way, so this client sends it on the input socket
(to every engine: each ignores the message when it is the one excluded).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import attrs

from ..protocol import EngineCoreOutputs, RequestType
from ..protocol.packing import pack

__all__ = ["StartWave", "WaveControl", "WaveState", "encode_start_dp_wave"]

logger = logging.getLogger("anyio_genout.engine")


@attrs.frozen
class StartWave:
    """``START_DP_WAVE``: start wave ``wave`` on every engine but ``exclude`` (None: all)."""

    wave: int
    exclude: int | None

    def frames(self) -> list[bytes]:
        """The message frames (after the engine's identity)."""
        return encode_start_dp_wave(self.wave, self.exclude)


def encode_start_dp_wave(wave: int, exclude: int | None) -> list[bytes]:
    """Frames ``[START_DP_WAVE, msgpack([wave, exclude])]``."""
    return [RequestType.START_DP_WAVE.value, pack([wave, exclude])]


@attrs.define
class WaveState:
    """The group's wave number and whether it runs, as this client knows them."""

    current_wave: int = 0
    engines_running: bool = False
    #: START_DP_WAVE messages decided (each counted once, however many engines get it).
    wakeups: int = 0

    def request(self, target: int) -> tuple[int, StartWave | None]:
        """A request goes to engine ``target``: the wave to stamp on it, and the wake-up
        to send first if the engines are paused (after which they count as running)."""
        if self.engines_running:
            return self.current_wave, None
        self.engines_running = True
        self.wakeups += 1
        return self.current_wave, StartWave(self.current_wave, target)

    def wave_complete(self, wave: int, unfinished: int) -> StartWave | None:
        """An engine reports wave ``wave`` complete while ``unfinished`` requests this
        client sent that engine have not ended: the state pauses (unless the wave is
        older); returns the wake-up to send if that engine holds unfinished requests and
        nothing woke the group since (see the module docstring)."""
        if wave >= self.current_wave:
            self.current_wave = wave + 1
            self.engines_running = False
        elif wave != self.current_wave - 1:
            return None  # older than the last wave: nothing to do
        if unfinished and not self.engines_running:
            self.engines_running = True
            self.wakeups += 1
            return StartWave(self.current_wave, None)
        return None

    def start_wave(self, wave: int, sender: int) -> StartWave | None:
        """Engine ``sender`` reports it started wave ``wave`` (a request of an older wave
        reached it while paused): the wake-up to rebroadcast, or None if not newer."""
        if wave > self.current_wave or (wave == self.current_wave
                                        and not self.engines_running):
            self.current_wave = wave
            self.engines_running = True
            self.wakeups += 1
            return StartWave(wave, sender)
        return None


class WaveControl:
    """:class:`WaveState` wired to a client: it queues the wake-ups it decides (``send``
    queues a message for one engine, never waits) to the ``engines`` up."""

    __slots__ = ("_engines", "_send", "_unfinished", "state")

    def __init__(self, send: Callable[[int, list[bytes]], None], engines: Collection[int],
                 unfinished: Callable[[int], int]) -> None:
        """``engines``: the ranks of the engines up (the client's set, kept current by it);
        ``unfinished(engine)``: requests sent to ``engine`` that have not ended."""
        self._send = send
        self._engines = engines
        self._unfinished = unfinished
        self.state = WaveState()

    @property
    def current_wave(self) -> int:
        """The wave a request sent now carries."""
        return self.state.current_wave

    def request(self, target: int) -> None:
        """A request stamped with :attr:`current_wave` is about to be queued for engine
        ``target``: wake the others first if the group is paused. Raises what ``send``
        raises."""
        self._broadcast(self.state.request(target)[1])

    def control(self, message: EngineCoreOutputs) -> None:
        """An engine's ``wave_complete`` / ``start_wave`` (from the reader, never waits)."""
        state = self.state
        if message.wave_complete is not None:
            logger.debug("engine %d completed wave %d", message.engine_index,
                         message.wave_complete)
            self._broadcast(state.wave_complete(message.wave_complete,
                                                self._unfinished(message.engine_index)))
        if message.start_wave is not None:
            logger.debug("engine %d started wave %d", message.engine_index,
                         message.start_wave)
            self._broadcast(state.start_wave(message.start_wave, message.engine_index))

    def _broadcast(self, start: StartWave | None) -> None:
        if start is None:
            return
        frames = start.frames()
        for engine in sorted(self._engines):
            self._send(engine, frames)
