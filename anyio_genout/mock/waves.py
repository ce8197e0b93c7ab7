"""Mock engines in one process acting as a data-parallel MoE group in lockstep waves.

Give every :class:`~anyio_genout.mock.MockEngine` of the group the same :class:`WaveGroup`
(``MockEngine(config, waves=group)``). What the group does, as vLLM 0.32's
``DPEngineCoreProc`` does it:

* an engine steps only while **every** engine of the group is running (the collective:
  a real engine that gets a request while its peers are paused steps into the all-reduce
  and waits there until they are woken); a running engine with nothing to do runs a
  **dummy step** (no outputs);
* after a step, if no engine of the group has an unfinished request, the wave ends for all
  of them at once: each pauses and moves to ``current_wave + 1``, and the lowest rank
  sends ``EngineCoreOutputs(wave_complete=w)``;
* an ADD carrying ``current_wave`` newer than the engine's moves the engine to it; one
  carrying an older wave while the engine is paused makes it send
  ``EngineCoreOutputs(start_wave=current_wave)``; any ADD sets the engine running;
* ``START_DP_WAVE [wave, exclude]`` on the input socket: unless this engine is the one
  excluded or ``wave`` is older than its own, it moves to ``wave`` and runs.

What is not like vLLM: the engines do not step in true lockstep (each steps at its own
pace while all run; only the start and the end of a wave are group-wide), there is no
``dp_sync_interval`` (the idle check runs after every step) and no pause-consensus phase,
and there is no coordinator process: the wave messages go on the engine's output socket
(to every front end), where a real engine started without a coordinator sends
``wave_complete`` (from every rank, not only the lowest) and never ``start_wave``, which
a real engine sends to a coordinator only. The group lives in one process, so the
engines of a group cannot be separate ``python -m anyio_genout mock-engine`` processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack

from .wire import pack

__all__ = ["WaveGroup", "WaveMember"]


class WaveMember:
    """One engine's wave state (``current_wave``, ``running``) and what it saw."""

    def __init__(self, group: WaveGroup, rank: int, unfinished: Callable[[], bool],
                 send: Callable[[list[bytes | memoryview]], None]) -> None:
        self.group = group
        self.rank = rank
        self.current_wave = 0
        self.running = False
        self.dummy_steps = 0
        #: ``(wave, exclude)`` of every START_DP_WAVE received, in order.
        self.start_dp_waves: list[tuple[int, int | None]] = []
        #: Waves this engine reported with ``start_wave`` (stale requests while paused).
        self.start_waves_sent: list[int] = []
        self._unfinished = unfinished
        self._send = send

    @property
    def unfinished(self) -> bool:
        return self._unfinished()

    def add(self, request_wave: int) -> None:
        """An ADD stamped ``request_wave`` arrived."""
        if request_wave > self.current_wave:
            self.current_wave = request_wave
        elif request_wave < self.current_wave and not self.running:
            self.start_waves_sent.append(self.current_wave)
            self.send_control(start_wave=self.current_wave)
        self.running = True

    def start_dp_wave(self, payload: bytes) -> str | None:
        """A START_DP_WAVE message; returns an error text if it is malformed."""
        try:
            value = msgpack.unpackb(payload)
        except ValueError as exc:
            return f"START_DP_WAVE: undecodable payload ({exc})"
        if not (type(value) is list and len(value) == 2 and type(value[0]) is int
                and (value[1] is None or type(value[1]) is int)):
            return f"START_DP_WAVE: expected [wave, exclude], got {value!r}"
        wave, exclude = value
        self.start_dp_waves.append((wave, exclude))
        if exclude != self.rank and wave >= self.current_wave:
            self.current_wave = wave
            self.running = True
        return None

    def wants_step(self, has_step_work: bool) -> bool:
        """Whether the engine would step (it has work, or the group runs)."""
        return has_step_work or self.running

    def may_step(self) -> bool:
        """Whether the collective lets it step now: every engine of the group runs."""
        return all(m.running for m in self.group.members)

    def dummy_step(self) -> None:
        self.dummy_steps += 1

    def after_step(self) -> None:
        """After a step (real or dummy): end the wave if the whole group is idle."""
        self.group.end_wave_if_idle()

    def send_control(self, *, wave_complete: int | None = None,
                     start_wave: int | None = None) -> None:
        self._send([pack([self.rank, [], None, time.monotonic(), None, None, wave_complete,
                          start_wave, None])])


class WaveGroup:
    """The engines of one data-parallel group (shared by their :class:`MockEngine`\\ s).

    ``waves_completed``: waves that ended (counted once for the group)."""

    def __init__(self) -> None:
        self.members: list[WaveMember] = []
        self.waves_completed = 0

    def join(self, rank: int, unfinished: Callable[[], bool],
             send: Callable[[list[bytes | memoryview]], None]) -> WaveMember:
        """Add engine ``rank``: ``unfinished()`` tells whether it has requests left,
        ``send(frames)`` sends an output message to its front ends."""
        member = WaveMember(self, rank, unfinished, send)
        self.members.append(member)
        self.members.sort(key=lambda m: m.rank)
        return member

    def end_wave_if_idle(self) -> None:
        members = self.members
        if not all(m.running for m in members) or any(m.unfinished for m in members):
            return
        wave = members[0].current_wave
        for m in members:
            m.running = False
            m.current_wave += 1
        self.waves_completed += 1
        members[0].send_control(wave_complete=wave)
