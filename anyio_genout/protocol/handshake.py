"""The start-up handshake between a front end and its engines.

1. The engine's DEALER (identity = data-parallel rank as 2 bytes little-endian) connects to
   the front end's handshake ROUTER and sends HELLO ``{status, local, headless}``.
2. The front end answers INIT ``{addresses: {inputs, outputs, coordinator_input,
   coordinator_output, frontend_stats_publish_address}, parallel_config}``.
3. The engine loads its model, connects to the input address and sends its
   ``EngineCoreReadyResponse`` map there (its "registration"), connects a PUSH to the output
   address, and sends READY on the handshake socket. The two may arrive in either order.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from ..errors import HandshakeError, ProtocolError, UnsupportedVersionError
from .arrays import describe
from .packing import pack, unpack

__all__ = [
    "SUPPORTED_VERSIONS",
    "EngineCoreReadyResponse",
    "EngineStatus",
    "HandshakeAddresses",
    "StatusMessage",
    "check_version",
    "decode_init",
    "decode_ready_response",
    "decode_status",
    "encode_init",
    "encode_ready_response",
    "encode_status",
    "engine_identity",
    "identity_rank",
]

#: vLLM minor versions whose wire layout this package speaks.
SUPPORTED_VERSIONS: Final = ("0.32", "0.33")


def engine_identity(rank: int) -> bytes:
    """ZMQ identity of the engine with data-parallel ``rank``."""
    return rank.to_bytes(2, "little")


def identity_rank(identity: bytes) -> int:
    if len(identity) != 2:
        raise HandshakeError(f"engine identity must be 2 bytes, got {bytes(identity)!r}")
    return int.from_bytes(identity, "little")


class EngineStatus(enum.StrEnum):
    HELLO = "HELLO"
    READY = "READY"


@attrs.frozen
class StatusMessage:
    """HELLO or READY from an engine on the handshake socket."""

    status: EngineStatus
    local: bool = False
    headless: bool = True
    extra: Mapping[str, Any] = attrs.field(factory=dict)


def encode_status(message: StatusMessage) -> bytes:
    return pack({"status": message.status.value, "local": message.local,
                 "headless": message.headless, **message.extra})


def decode_status(data: bytes) -> StatusMessage:
    """Decode HELLO or READY; raises :class:`HandshakeError` (a bad frame is no engine)."""
    try:
        value = unpack(data, "handshake message")
    except ProtocolError as exc:
        raise HandshakeError(str(exc)) from None
    if type(value) is not dict or value.get("status") not in ("HELLO", "READY"):
        raise HandshakeError(f"handshake message: expected a HELLO or READY map, got "
                             f"{describe(value)}")
    for key in ("local", "headless"):
        if key in value and type(value[key]) is not bool:
            raise HandshakeError(f"handshake message.{key}: expected a bool, got "
                                 f"{describe(value[key])}")
    extra = {k: v for k, v in value.items() if k not in ("status", "local", "headless")}
    return StatusMessage(EngineStatus(value["status"]), value.get("local", False),
                         value.get("headless", True), extra)


@attrs.frozen
class HandshakeAddresses:
    """INIT: where the engine must connect its input DEALER and output PUSH."""

    inputs: Sequence[str]
    outputs: Sequence[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None
    parallel_config: Mapping[str, Any] = attrs.field(factory=dict)


def encode_init(addresses: HandshakeAddresses) -> bytes:
    return pack({
        "addresses": {
            "inputs": list(addresses.inputs),
            "outputs": list(addresses.outputs),
            "coordinator_input": addresses.coordinator_input,
            "coordinator_output": addresses.coordinator_output,
            "frontend_stats_publish_address": addresses.frontend_stats_publish_address,
        },
        "parallel_config": dict(addresses.parallel_config),
    })


def decode_init(data: bytes) -> HandshakeAddresses:
    """Decode INIT (engine side); raises :class:`HandshakeError` naming the bad field."""
    try:
        value = unpack(data, "INIT")
    except ProtocolError as exc:
        raise HandshakeError(str(exc)) from None
    if type(value) is not dict or type(value.get("addresses")) is not dict:
        raise HandshakeError(f"INIT: expected a map with an addresses map, got "
                             f"{describe(value)}")
    addrs = value["addresses"]
    for key in ("inputs", "outputs"):
        addresses = addrs.get(key)
        if type(addresses) is not list or not addresses \
                or not all(type(a) is str for a in addresses):
            raise HandshakeError(f"INIT.addresses.{key}: expected a non-empty list of "
                                 f"addresses, got {describe(addresses)}")
    for key in ("coordinator_input", "coordinator_output", "frontend_stats_publish_address"):
        if addrs.get(key) is not None and type(addrs[key]) is not str:
            raise HandshakeError(f"INIT.addresses.{key}: expected an address or nil, got "
                                 f"{describe(addrs[key])}")
    parallel_config = value.get("parallel_config")
    if parallel_config is None:
        parallel_config = {}
    elif type(parallel_config) is not dict or not all(type(k) is str for k in parallel_config):
        raise HandshakeError(f"INIT.parallel_config: expected a map, got "
                             f"{describe(parallel_config)}")
    return HandshakeAddresses(
        addrs["inputs"], addrs["outputs"], addrs.get("coordinator_input"),
        addrs.get("coordinator_output"), addrs.get("frontend_stats_publish_address"),
        parallel_config,
    )


_READY_REQUIRED: Final = (
    "max_model_len", "num_gpu_blocks", "block_size", "dtype", "vllm_version",
    "data_parallel_rank", "max_num_seqs",
)


@attrs.frozen(kw_only=True)
class EngineCoreReadyResponse:
    """What an engine reports about itself when it registers on the input socket."""

    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    dtype: str
    vllm_version: str
    data_parallel_rank: int
    max_num_seqs: int
    max_num_batched_tokens: int = 0
    data_parallel_size: int = 1
    world_size: int = 1
    instance_id: str = ""
    supports_lora: bool = False
    max_loras: int = 0
    kv_cache_size_tokens: int | None = None
    enable_sleep_mode: bool = False
    raw: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)


def decode_ready_response(data: bytes) -> EngineCoreReadyResponse:
    """Decode the registration map; raises :class:`ProtocolError` naming a missing key."""
    value = unpack(data, "EngineCoreReadyResponse")
    if type(value) is not dict:
        raise ProtocolError(f"EngineCoreReadyResponse: expected a map (vLLM >= 0.20), got "
                            f"{describe(value)}")
    for key in _READY_REQUIRED:
        if key not in value:
            raise ProtocolError(f"EngineCoreReadyResponse.{key}: missing")
    fields: dict[str, Any] = {}
    for key, types in _READY_TYPES.items():
        v = value.get(key)
        if v is None and key not in _READY_REQUIRED:
            continue
        if type(v) not in types:
            names = " or ".join(t.__name__ for t in types)
            raise ProtocolError(f"EngineCoreReadyResponse.{key}: expected {names}, got "
                                f"{describe(v)}")
        fields[key] = v
    return EngineCoreReadyResponse(**fields, raw=value)


_READY_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "max_model_len": (int,), "num_gpu_blocks": (int,), "block_size": (int,), "dtype": (str,),
    "vllm_version": (str,), "data_parallel_rank": (int,), "max_num_seqs": (int,),
    "max_num_batched_tokens": (int,), "data_parallel_size": (int,), "world_size": (int,),
    "instance_id": (str,), "supports_lora": (bool,), "max_loras": (int,),
    "kv_cache_size_tokens": (int,), "enable_sleep_mode": (bool,),
}


def encode_ready_response(response: EngineCoreReadyResponse) -> bytes:
    """The 0.32 layout (25 keys, in vLLM's declaration order)."""
    r = response
    return pack({
        "max_model_len": r.max_model_len, "num_gpu_blocks": r.num_gpu_blocks,
        "block_size": r.block_size, "dp_stats_address": None, "dtype": r.dtype,
        "vllm_version": r.vllm_version, "world_size": r.world_size,
        "data_parallel_size": r.data_parallel_size, "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
        "data_parallel_rank": r.data_parallel_rank, "max_num_seqs": r.max_num_seqs,
        "max_num_batched_tokens": r.max_num_batched_tokens, "instance_id": r.instance_id,
        "supports_lora": r.supports_lora, "max_loras": r.max_loras, "mamba_block_size": None,
        "kv_cache_size_tokens": r.kv_cache_size_tokens,
        "kv_cache_max_concurrency": None, "kv_events_config": None,
        "weight_transfer_backend": None, "enable_sleep_mode": r.enable_sleep_mode,
        "supports_draft_weight_updates": False, "effective_attention_block_size": r.block_size,
    })


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedVersionError` unless ``version`` is 0.32.x or 0.33.x."""
    parts = version.split(".")
    minor = ".".join(parts[:2])
    if minor not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(version, " and ".join(f"{v}.x" for v in SUPPORTED_VERSIONS))
