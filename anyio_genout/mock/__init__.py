"""A mock vLLM engine core for tests and benchmarks.

It is an engine, not a shortcut: it performs the real start-up handshake and speaks the real
wire protocol over real ZeroMQ sockets, so a client cannot tell it from ``vllm serve
--headless`` except by its (deterministic) tokens. Run it in-process with
``await MockEngine(config).serve()`` or as a process with ``python -m anyio_genout mock-engine``.
:func:`free_tcp_address` gives the handshake address a client and an in-process mock share
(:func:`free_tcp_port` its port alone).
"""

from ..transport import free_tcp_address, free_tcp_port
from .config import BLOCK_SIZE, MockEngineConfig, MockFaults
from .engine import MockEngine
from .tokens import greedy_tokens, sampled_tokens

__all__ = [
    "BLOCK_SIZE",
    "MockEngine",
    "MockEngineConfig",
    "MockFaults",
    "free_tcp_address",
    "free_tcp_port",
    "greedy_tokens",
    "sampled_tokens",
]
