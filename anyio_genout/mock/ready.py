"""The mock engine's registration message: the ready response a real engine sends on each
input socket (vLLM's ``EngineCoreReadyResponse`` plus the fields its version adds)."""

from __future__ import annotations

import msgpack

from ..errors import HandshakeError
from ..protocol import EngineCoreReadyResponse, encode_ready_response
from .config import MockEngineConfig
from .wire import pack

__all__ = ["ready_payload"]


def ready_payload(cfg: MockEngineConfig) -> bytes:
    """The ready response of an engine configured by ``cfg``, as vLLM ``cfg.vllm_version``
    packs it (0.33 adds the coordinator fields)."""
    blocks = cfg.gpu_blocks
    kv_tokens = blocks * cfg.block_size
    response = EngineCoreReadyResponse(
        max_model_len=cfg.max_model_len, num_gpu_blocks=blocks, block_size=cfg.block_size,
        dtype=cfg.dtype, vllm_version=cfg.vllm_version, data_parallel_rank=cfg.rank,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=max(cfg.max_model_len, 2048),
        instance_id=f"mock-engine-{cfg.rank}", kv_cache_size_tokens=kv_tokens,
        enable_sleep_mode=True,
    )
    wire = msgpack.unpackb(encode_ready_response(response), raw=False)
    if not isinstance(wire, dict):  # pragma: no cover - encode_ready_response packs a map
        raise HandshakeError("EngineCoreReadyResponse did not encode as a map")
    wire["kv_cache_max_concurrency"] = kv_tokens / cfg.max_model_len
    if _version_at_least(cfg.vllm_version, (0, 33)):
        wire.update(coord_store_port=0, coordinator_input_address=None,
                    coordinator_output_address=None)
    return pack(wire)


def _version_at_least(version: str, minimum: tuple[int, int]) -> bool:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= minimum
