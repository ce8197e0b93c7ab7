"""The label names and label values of the metric families, as vLLM spells them."""

from __future__ import annotations

from typing import Final

from ..protocol.outputs import FINISH_REASON_LABELS, finish_reason_label

__all__ = [
    "ADMISSION_REASONS",
    "CACHE_HIT_SOURCES",
    "FINISHED_REASONS",
    "LABELS",
    "PROMPT_TOKEN_SOURCES",
    "SLEEP_STATES",
    "WAITING_REASONS",
    "finish_reason_label",
]

#: The label names every family starts with.
LABELS: Final = ("model_name", "engine")
#: ``finished_reason`` label values, indexed by
#: :class:`~anyio_genout.protocol.EngineCoreFinishReason`: the protocol's own list (vLLM's
#: ``FINISH_REASON_STRINGS``), not a copy of it.
FINISHED_REASONS: Final = FINISH_REASON_LABELS
#: ``source`` label values of ``vllm:prompt_tokens_by_source``.
PROMPT_TOKEN_SOURCES: Final = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: ``reason`` label values of ``vllm:num_requests_waiting_by_reason``.
WAITING_REASONS: Final = ("capacity", "deferred")
#: ``source`` label values of ``vllm:prompt_tokens_cached_by_source`` (vLLM's
#: ``CacheHitSource``, in its order: the tier that supplied the cached tokens).
CACHE_HIT_SOURCES: Final = ("device", "host", "p2p", "disk", "external_unspecified")
#: ``sleep_state`` label values of ``vllm:engine_sleep_state``.
SLEEP_STATES: Final = ("awake", "weights_offloaded", "discard_all")
#: ``reason`` label values of ``vllm:admission_rejections`` (vLLM's ``--max-num-queued-reqs``
#: and ``--max-num-queued-tokens`` limits).
ADMISSION_REASONS: Final = ("max_num_queued_reqs", "max_num_queued_tokens")
