"""Front end <- engine: encoding an ``EngineCoreOutputs`` message, as an engine writes it.

The engine side of :mod:`.outputs`, used by the mock engine (and tests and benchmarks) to
produce exactly the frames a vLLM 0.32 (18-field rows) or 0.33 (19-field rows) engine sends.
"""

from __future__ import annotations

from typing import Any

import attrs

from .arrays import encode_array
from .logprobs import encode_logprobs, encode_sampling_mask
from .outputs import EngineCoreOutput, EngineCoreOutputs
from .packing import pack

__all__ = ["encode_outputs"]


def encode_outputs(message: EngineCoreOutputs, *, fields: int = 18) -> list[bytes | memoryview]:
    """Frames for ``message`` as a vLLM engine writes them (``fields``: 18 = 0.32, 19 = 0.33)."""
    aux: list[bytes | memoryview] = [b""]
    util = message.utility_output
    wire = [
        message.engine_index,
        [_encode_output(o, aux, fields) for o in message.outputs],
        None if message.scheduler_stats is None else message.scheduler_stats.to_wire(),
        float(message.timestamp),
        None if util is None else [
            util.call_id, util.failure_message, [None, util.result] if util.has_result else None
        ],
        None if message.finished_requests is None else sorted(message.finished_requests),
        message.wave_complete,
        message.start_wave,
        message.weight_version,
    ]
    aux[0] = pack(wire)
    return aux


def _encode_output(o: EngineCoreOutput, aux: list[bytes | memoryview],
                   fields: int) -> list[Any]:
    row: list[Any] = [
        o.request_id,
        o.new_token_ids,
        None if o.new_logprobs is None else encode_logprobs(o.new_logprobs, aux),
        None if o.new_prompt_logprobs is None else encode_logprobs(
            o.new_prompt_logprobs, aux, prompt=True),
        None if o.pooling_output is None else encode_array(o.pooling_output, aux),
        None if o.finish_reason is None else int(o.finish_reason),
        o.stop_reason,
        None if o.events is None else [
            {"type": int(e.type), "timestamp": e.timestamp} for e in o.events
        ],
        o.kv_transfer_params,
        o.ec_transfer_params,
        o.trace_headers,
        None if o.prefill_stats is None else attrs.asdict(o.prefill_stats),
        None if o.routed_experts is None else encode_array(o.routed_experts, aux),
        o.num_nans_in_logits,
        o.mm_cache_miss_hashes,
        None if o.new_sampling_mask is None else encode_sampling_mask(o.new_sampling_mask, aux),
        o.spec_decode_metrics,
        None if o.prompt_token_id_logprobs is None else encode_array(
            o.prompt_token_id_logprobs, aux),
        None if o.error is None else attrs.asdict(o.error),
    ]
    return row[:fields]
