"""The engine-core client: sockets, handshake, the reader task, requests and utility calls."""

from .client import EngineCoreClient
from .config import (
    DEFAULT_HANDSHAKE_ADDRESS,
    BootstrappedTransport,
    EngineCoreClientConfig,
    HandshakeTransport,
    HealthConfig,
    RoutingConfig,
)
from .mailbox import EngineCoreStreamOutput
from .stream import EngineCoreOutputStream, StreamState

__all__ = [
    "DEFAULT_HANDSHAKE_ADDRESS",
    "BootstrappedTransport",
    "EngineCoreClient",
    "EngineCoreClientConfig",
    "EngineCoreOutputStream",
    "EngineCoreStreamOutput",
    "HandshakeTransport",
    "HealthConfig",
    "RoutingConfig",
    "StreamState",
]
