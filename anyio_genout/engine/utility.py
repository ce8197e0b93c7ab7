"""Utility calls of one engine client (a part it owns): :meth:`UtilityCalls.call` and typed
wrappers over it (vLLM's engine utility methods), which
:class:`~anyio_genout.EngineCoreClient` delegates to.

Each wrapper fans out to every engine; results are combined the way vLLM's own client does:
consensus (every engine must agree, else :class:`InconsistentUtilityResultsError`), AND, or
flattened in engine order.

Every wrapper raises what :meth:`EngineCoreClient.call_utility` raises:
:class:`~anyio_genout.UtilityCallError` when an engine's method failed (after every engine
answered), and the client's sticky :class:`~anyio_genout.ClientUnhealthyError` (an engine
died, the client closed) at once or while waiting; the consensus wrappers
(``get_supported_tasks``, ``is_sleeping``, ``is_scheduler_paused``) also raise
:class:`~anyio_genout.InconsistentUtilityResultsError` when the engines disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio.lowlevel

from ..errors import InconsistentUtilityResultsError
from .health import Health
from .registry import RequestRegistry
from .utility_calls import PendingCalls

__all__ = ["SleepListener", "UtilityCalls"]

#: ``listener(sleep, level)``: the engines went to sleep (1, level) or woke up (0, 0).
SleepListener = Callable[[int, int], None]


class UtilityCalls:
    """Calls to every engine up, over the client's :class:`~.utility_calls.PendingCalls`."""

    def __init__(self, pending: PendingCalls, health: Health,
                 registry: RequestRegistry) -> None:
        """``health`` says which engines are up; ``registry`` why none is."""
        self._pending = pending
        self._health = health
        self._registry = registry
        self._sleep_listeners: list[SleepListener] = []

    async def call_utility(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine up; their results in engine order (see
        :meth:`EngineCoreClient.call_utility <.client.EngineCoreClient.call_utility>`)."""
        live = self._health.live_engines
        if not live and self._health.error is None:
            await anyio.lowlevel.checkpoint()
            raise self._registry.none_up_error()
        return await self._pending.call(live, method, args)

    def add_sleep_listener(self, listener: SleepListener) -> None:
        """Call ``listener(sleep, level)`` after :meth:`sleep` succeeded (``sleep`` 1, its
        ``level``) and after a :meth:`wake_up` every engine says left it fully awake
        (``0, 0``), as vLLM's front end records ``vllm:engine_sleep_state``."""
        self._sleep_listeners.append(listener)

    async def _consensus(self, method: str, *args: Any) -> Any:
        results = await self.call_utility(method, *args)
        if any(r != results[0] for r in results[1:]):
            raise InconsistentUtilityResultsError(method, results)
        return results[0]

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return tuple(await self._consensus("get_supported_tasks"))

    async def is_sleeping(self) -> bool:
        return bool(await self._consensus("is_sleeping"))

    async def is_scheduler_paused(self) -> bool:
        return bool(await self._consensus("is_scheduler_paused"))

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        results = await self.call_utility("reset_prefix_cache", reset_running_requests,
                                          reset_connector)
        return all(bool(r) for r in results)

    async def reset_mm_cache(self) -> None:
        await self.call_utility("reset_mm_cache")

    async def reset_encoder_cache(self) -> None:
        await self.call_utility("reset_encoder_cache")

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self.call_utility("sleep", level, mode)
        for listener in list(self._sleep_listeners):
            listener(1, level)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        results = await self.call_utility("wake_up", None if tags is None else list(tags))
        if all(results):  # each engine says it is fully awake (vLLM 0.32's result)
            for listener in list(self._sleep_listeners):
                listener(0, 0)

    async def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self.call_utility("pause_scheduler", mode, clear_cache)

    async def resume_scheduler(self) -> None:
        await self.call_utility("resume_scheduler")

    async def add_lora(self, lora: Any) -> bool:
        wire = lora.to_wire() if hasattr(lora, "to_wire") else lora
        return all(bool(r) for r in await self.call_utility("add_lora", wire))

    async def remove_lora(self, lora_id: int) -> bool:
        return all(bool(r) for r in await self.call_utility("remove_lora", lora_id))

    async def list_loras(self) -> set[int]:
        found: set[int] = set()
        for result in await self.call_utility("list_loras"):
            found.update(result or ())
        return found

    async def start_profile(self, prefix: str | None = None) -> None:
        await self.call_utility("profile", True, prefix)

    async def stop_profile(self) -> None:
        await self.call_utility("profile", False, None)

    async def collective_rpc(self, method: str, worker_timeout: float | None = None,
                             args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
                             ) -> list[Any]:
        """Run ``method`` on every worker of every engine; results flattened in engine order."""
        flat: list[Any] = []
        for result in await self.call_utility("collective_rpc", method, worker_timeout, list(args),
                                              kwargs or {}):
            if isinstance(result, list):
                flat.extend(result)
            else:
                flat.append(result)
        return flat
