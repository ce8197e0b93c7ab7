"""A mock vLLM engine core for tests and benchmarks.

It is an engine, not a shortcut: it performs the real start-up handshake and speaks the real
wire protocol over real ZeroMQ sockets, so a client cannot tell it from ``vllm serve
--headless`` except by its (deterministic) tokens. Run it in-process with
``await MockEngine(config).serve()`` or as a process with ``python -m anyio_genout mock-engine``.
"""

from .config import BLOCK_SIZE, MockEngineConfig, MockFaults
from .engine import MockEngine
from .tokens import greedy_tokens, sampled_tokens

__all__ = [
    "BLOCK_SIZE",
    "MockEngine",
    "MockEngineConfig",
    "MockFaults",
    "greedy_tokens",
    "sampled_tokens",
]
