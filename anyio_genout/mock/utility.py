"""Utility calls on the mock engine: :class:`UtilityCalls` runs them on the ``EngineCoreProc``
facade.

A UTILITY request names a method, and :meth:`UtilityCalls.call` calls it with ``getattr`` on
:class:`EngineCoreProc`: every public attribute of that class is callable by a client, so it
holds nothing but utility methods. The facade keeps no state of its own: it works through
its :class:`UtilityCalls`, which holds the sleep level and the deferred replies, and the
engine's :class:`~.scheduler.Scheduler` and :class:`~.wire.OutputWriter` (by their public
methods; the writer keeps the weight version every step's message carries). A reply may be
deferred: with ``mode="wait"``, ``pause_scheduler`` and ``sleep`` leave the reply for
:meth:`UtilityCalls.resolve_pauses`, which the engine runs after every step and when idle,
to send once the running requests finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from ..protocol import UtilityRequest
from .scheduler import Pause, Scheduler
from .wire import OutputWriter

__all__ = ["EngineCoreProc", "UtilityCalls"]

_SUPPORTED_TASKS: Final = ("generate",)
_PAUSE_MODES: Final = ("abort", "wait", "keep")
_DEFERRED: Final = object()  # a utility whose reply waits for the engine to drain


class UtilityCalls:
    """Runs clients' utility calls and sends their replies (the utility part of
    :class:`~.engine.MockEngine`). ``sleep_level`` is the level the engine sleeps at (0:
    awake)."""

    def __init__(self, scheduler: Scheduler, writer: OutputWriter) -> None:
        self.scheduler = scheduler
        self.writer = writer
        self.sleep_level = 0
        self._proc = EngineCoreProc(self)
        self._pending: list[tuple[int, int, Callable[[], None] | None]] = []
        self._current: tuple[int, int] = (0, 0)

    def call(self, call: UtilityRequest) -> None:
        """Run ``call`` and send its reply (a failure reply when the method raised), or
        leave the reply for :meth:`resolve_pauses`."""
        writer = self.writer
        if not 0 <= call.client_index < writer.num_clients:
            writer.errors.append(f"utility {call.method!r}: client_index {call.client_index} "
                                 f"has no output socket; dropped")
            return
        self._current = (call.client_index, call.call_id)
        method = call.method
        try:
            if method.startswith("_"):
                raise AttributeError(f"'EngineCoreProc' object has no attribute '{method}'")
            result = getattr(self._proc, method)(*call.args)
        except Exception as exc:
            writer.send_utility(call.client_index, call.call_id,
                                f"Call to {method} method failed: {exc}", None)
            return
        if result is _DEFERRED:
            return
        writer.send_utility(call.client_index, call.call_id, None, result)

    def pause(self, mode: str, clear_cache: bool, then: Callable[[], None] | None) -> object:
        """Pause the scheduler (vLLM's modes); ``then`` runs once paused. Returns the
        marker of a deferred reply with ``mode="wait"`` while requests still run.

        Raises :class:`ValueError` on an unknown ``mode`` (the client gets the failure).
        """
        if mode not in _PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        sched = self.scheduler
        if mode == "abort":
            sched.abort_everything(shutdown=False)
        sched.pause = Pause.ALL if mode == "keep" else Pause.NEW
        if clear_cache:
            sched.reset_prefix_cache()
        if mode == "wait" and sched.running_alive():
            self._pending.append((*self._current, then))
            return _DEFERRED
        if then is not None:
            then()
        return None

    def resolve_pauses(self) -> None:
        """Send the deferred replies once no request runs any more."""
        if not self._pending or self.scheduler.running_alive():
            return
        pending, self._pending = self._pending, []
        for client, call_id, then in pending:
            if then is not None:
                then()
            self.writer.send_utility(client, call_id, None, None)


class EngineCoreProc:
    """The utility methods a client may call (named like vLLM's class, so its error texts
    match: an unknown method fails with ``'EngineCoreProc' object has no attribute ...``).
    """

    __slots__ = ("_calls",)

    def __init__(self, calls: UtilityCalls) -> None:
        self._calls = calls

    def get_supported_tasks(self) -> list[str]:
        return list(_SUPPORTED_TASKS)

    def is_sleeping(self) -> bool:
        calls = self._calls
        return calls.scheduler.pause is not Pause.UNPAUSED or calls.sleep_level > 0

    def is_scheduler_paused(self) -> bool:
        return self._calls.scheduler.pause is not Pause.UNPAUSED

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> object:
        return self._calls.pause(mode, clear_cache, None)

    def resume_scheduler(self) -> None:
        self._calls.scheduler.pause = Pause.UNPAUSED

    def sleep(self, level: int = 1, mode: str = "abort") -> object:
        calls = self._calls

        def fall_asleep() -> None:
            calls.sleep_level = level

        return calls.pause(mode, level >= 1, fall_asleep if level >= 1 else None)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        calls = self._calls
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            calls.sleep_level = 0
        fully_awake = calls.sleep_level == 0
        if fully_awake:
            calls.scheduler.pause = Pause.UNPAUSED
        return fully_awake

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        sched = self._calls.scheduler
        if sched.running_alive():
            if not reset_running_requests:
                return False  # blocks still in use, as vLLM's block pool refuses
            sched.preempt_all(time.monotonic())
        sched.reset_prefix_cache()
        return True

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def list_loras(self) -> list[int]:
        return []

    def collective_rpc(self, method: str, timeout: float | None = None,
                       args: list[Any] | None = None,
                       kwargs: dict[str, Any] | None = None) -> list[str]:
        return [f"engine-{self._calls.writer.config.rank}-worker"]

    def get_weight_version(self) -> str:
        return self._calls.writer.weight_version

    def set_weight_version(self, weight_version: str) -> None:
        self._calls.writer.set_weight_version(str(weight_version))

    def profile(self, is_start: bool = True, profile_prefix: str | None = None,
                delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        return None

    def execute_dummy_batch(self) -> None:
        return None
