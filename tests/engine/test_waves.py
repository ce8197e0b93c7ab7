"""The data-parallel wave state machine (engine/waves.py), pure: the cases the Rust client's
coordinator tests pin (reference engine-core-client.md, coordinator tests 3 and 4 and
coordinator/inproc.rs) and vLLM 0.32's DPCoordinator rules."""

from __future__ import annotations

import msgpack

from anyio_genout.engine.waves import StartWave, WaveControl, WaveState, encode_start_dp_wave
from anyio_genout.protocol import EngineCoreOutputs


def test_first_request_wakes_the_others_once_and_running_requests_do_not() -> None:
    # coordinator_wave_control_tracks_pause_running_and_rebroadcasts, first half
    state = WaveState()
    assert state.request(0) == (0, StartWave(0, 0))
    assert state.engines_running
    assert state.request(1) == (0, None)  # running: no second broadcast
    assert state.wakeups == 1


def test_wave_complete_pauses_and_the_next_request_starts_the_next_wave() -> None:
    # ... second half: WaveComplete(0) -> paused, wave 1; req-3 -> broadcast (1, 0), wave 1
    state = WaveState()
    state.request(0)
    assert state.wave_complete(0, unfinished=0) is None
    assert (state.current_wave, state.engines_running) == (1, False)
    assert state.request(0) == (1, StartWave(1, 0))


def test_the_first_request_of_wave_3_excludes_its_target() -> None:
    # coordinator/inproc.rs first_request_for_current_wave_excludes_target (wave 3, exclude 2)
    state = WaveState(current_wave=3)
    assert state.request(2) == (3, StartWave(3, 2))


def test_repeated_and_stale_wave_complete_are_ignored() -> None:
    # Without a coordinator every engine reports the same completion.
    state = WaveState(current_wave=5, engines_running=True)
    assert state.wave_complete(5, unfinished=0) is None
    assert state.wave_complete(5, unfinished=0) is None
    assert state.wave_complete(4, unfinished=0) is None
    assert (state.current_wave, state.engines_running) == (6, False)


def test_a_later_wave_complete_jumps_ahead() -> None:
    state = WaveState(current_wave=2, engines_running=True)
    state.wave_complete(7, unfinished=0)
    assert (state.current_wave, state.engines_running) == (8, False)


def test_engine_start_wave_is_followed_and_rebroadcast_excluding_the_sender() -> None:
    # coordinator_rebroadcasts_engine_start_wave_control: StartWave(4) from engine 1
    state = WaveState()
    assert state.start_wave(4, sender=1) == StartWave(4, 1)
    assert (state.current_wave, state.engines_running) == (4, True)
    assert state.request(0) == (4, None)  # running: the request wakes nobody


def test_start_wave_of_the_current_wave_counts_only_while_paused() -> None:
    state = WaveState(current_wave=3)
    assert state.start_wave(3, sender=0) == StartWave(3, 0)  # paused: follow
    assert state.start_wave(3, sender=1) is None  # running already
    assert state.start_wave(2, sender=1) is None  # older
    assert (state.current_wave, state.engines_running) == (3, True)


def test_a_wave_that_completes_with_requests_unfinished_wakes_every_engine() -> None:
    # A request stamped for the wave that just completed may sit on a paused engine that
    # waits in the collective; an engine without a coordinator never says so.
    state = WaveState(current_wave=0, engines_running=True)
    assert state.wave_complete(0, unfinished=1) == StartWave(1, None)
    assert (state.current_wave, state.engines_running) == (1, True)
    assert state.wave_complete(0, unfinished=1) is None  # woken already


def test_the_repeat_from_the_engine_holding_the_late_request_wakes_the_group() -> None:
    # Without a coordinator every engine reports the pause; the engine whose request came
    # too late may be the second to say so.
    state = WaveState(current_wave=0, engines_running=True)
    assert state.wave_complete(0, unfinished=0) is None  # engine 0: nothing of ours left
    assert state.wave_complete(0, unfinished=1) == StartWave(1, None)  # engine 1
    assert (state.current_wave, state.engines_running) == (1, True)


def test_a_late_repeat_after_a_new_wave_started_wakes_nobody() -> None:
    state = WaveState(current_wave=0, engines_running=True)
    state.wave_complete(0, unfinished=0)
    assert state.request(1) == (1, StartWave(1, 1))
    assert state.wave_complete(0, unfinished=1) is None  # the request woke the group
    state = WaveState(current_wave=3)
    assert state.wave_complete(1, unfinished=1) is None  # older than the last wave


def test_start_dp_wave_frames_are_type_2_and_wave_then_exclude() -> None:
    kind, payload = encode_start_dp_wave(4, 1)
    assert kind == b"\x02"
    assert msgpack.unpackb(payload) == [4, 1]
    assert msgpack.unpackb(StartWave(1, None).frames()[1]) == [1, None]


def test_control_broadcasts_to_every_engine_up_and_counts_unfinished() -> None:
    sent: list[tuple[int, list[object]]] = []
    unfinished = {0: 0, 1: 0, 2: 0}
    control = WaveControl(lambda engine, frames: sent.append(
        (engine, msgpack.unpackb(frames[1]))), {2, 0, 1}, unfinished.__getitem__)
    control.request(1)
    assert sent == [(0, [0, 1]), (1, [0, 1]), (2, [0, 1])]
    sent.clear()
    control.control(EngineCoreOutputs(engine_index=0, wave_complete=0))
    assert sent == [] and control.current_wave == 1
    control.control(EngineCoreOutputs(engine_index=2, start_wave=1))
    assert sent == [(0, [1, 2]), (1, [1, 2]), (2, [1, 2])]
    sent.clear()
    unfinished[2] = 3  # engine 0's report does not count engine 2's requests
    control.control(EngineCoreOutputs(engine_index=0, wave_complete=1))
    assert sent == []
    control.control(EngineCoreOutputs(engine_index=2, wave_complete=1))
    assert sent == [(0, [2, None]), (1, [2, None]), (2, [2, None])]
