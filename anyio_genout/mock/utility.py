"""The utility methods a client may call on the mock engine: the ``EngineCoreProc`` facade.

A UTILITY request names a method, and ``MockEngine._call_utility`` calls it with ``getattr``
on the engine's :class:`EngineCoreProc`: every public attribute of that class is callable by
a client, so it must hold nothing but utility methods. The facade keeps no state of its own:
it reads and writes the engine's (the :class:`~.scheduler.Pause` state, the sleep level, the
weight version and its packed bytes, which every step's message carries) and calls the
engine's methods. A reply may be deferred: with ``mode="wait"``, ``pause_scheduler`` and
``sleep`` return the engine's marker while requests still run, and the engine replies once
they finished.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

from .scheduler import Pause
from .wire import pack

if TYPE_CHECKING:
    from .engine import MockEngine

__all__ = ["EngineCoreProc"]

_SUPPORTED_TASKS: Final = ("generate",)


class EngineCoreProc:
    """The utility methods a client may call (named like vLLM's class, so its error texts
    match: an unknown method fails with ``'EngineCoreProc' object has no attribute ...``).
    """

    __slots__ = ("_engine",)

    def __init__(self, engine: MockEngine) -> None:
        self._engine = engine

    def get_supported_tasks(self) -> list[str]:
        return list(_SUPPORTED_TASKS)

    def is_sleeping(self) -> bool:
        e = self._engine
        return e._pause is not Pause.UNPAUSED or e._sleep_level > 0

    def is_scheduler_paused(self) -> bool:
        return self._engine._pause is not Pause.UNPAUSED

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> object:
        return self._engine._pause_scheduler(mode, clear_cache, None)

    def resume_scheduler(self) -> None:
        self._engine._pause = Pause.UNPAUSED

    def sleep(self, level: int = 1, mode: str = "abort") -> object:
        engine = self._engine

        def fall_asleep() -> None:
            engine._sleep_level = level

        return engine._pause_scheduler(mode, level >= 1, fall_asleep if level >= 1 else None)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        engine = self._engine
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            engine._sleep_level = 0
        fully_awake = engine._sleep_level == 0
        if fully_awake:
            engine._pause = Pause.UNPAUSED
        return fully_awake

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        engine = self._engine
        if engine._running_alive():
            if not reset_running_requests:
                return False  # blocks still in use, as vLLM's block pool refuses
            engine._preempt_all(time.monotonic())
        engine._reset_prefix_cache()
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
        return [f"engine-{self._engine.config.rank}-worker"]

    def get_weight_version(self) -> str:
        return self._engine._weight_version

    def set_weight_version(self, weight_version: str) -> None:
        self._engine._weight_version = str(weight_version)
        self._engine._weight_version_bytes = pack(str(weight_version))

    def profile(self, is_start: bool = True, profile_prefix: str | None = None,
                delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        return None

    def execute_dummy_batch(self) -> None:
        return None
