"""How an :class:`~anyio_genout.EngineCoreClient` finds and talks to its engines."""

from __future__ import annotations

from typing import Final

import attrs

from ..transport import DEFAULT_MAX_MESSAGE_SIZE

__all__ = ["DEFAULT_HANDSHAKE_ADDRESS", "EngineCoreClientConfig"]

#: vLLM's default ``--data-parallel-rpc-port`` on loopback.
DEFAULT_HANDSHAKE_ADDRESS: Final = "tcp://127.0.0.1:29550"


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


@attrs.frozen(kw_only=True)
class EngineCoreClientConfig:
    """Connection settings.

    Two modes:

    * **Handshake owner** (default): the client binds a ROUTER at ``handshake_address``;
      engines started with ``vllm serve --headless --data-parallel-address H
      --data-parallel-rpc-port P`` dial it, and the client tells them where its input and
      output sockets are (bound on ``advertised_host``, or ``input_address`` /
      ``output_address`` when given; ``ipc://`` works too).
    * **Bootstrapped**: set ``bootstrapped=True`` with ``input_address`` and
      ``output_address``; engines ``engine_start_index .. engine_start_index+engine_count-1``
      connect there directly and register on the input socket.

    ``ready_timeout`` bounds the whole start-up (a real engine loads its model before READY,
    hence the 600 s default).

    Engines that die without saying so (``ENGINE_CORE_DEAD``) are found three ways, all on
    by default (docs/reliability.md has the measurements behind the defaults):

    * an engine's output connection that closes (process killed, or dropped by the
      heartbeat below) starts a probe: every engine must answer a cheap utility call, and an
      engine whose connection is not back within ``disconnect_grace`` seconds and that did
      not answer is dead;
    * ``heartbeat_interval``: ZeroMQ pings every engine connection of the input and output
      sockets that often (engines answer by themselves), and closes a connection that
      stays quiet for ``heartbeat_timeout`` seconds (a vanished host, a cut network);
      ``None`` turns heartbeats off;
    * ``liveness_interval``: every engine is asked a cheap utility call that often; one that
      does not answer within ``liveness_timeout`` is dead (an engine that is connected but
      hung or deaf). A utility call is answered between two engine steps, so the timeout
      must exceed the longest step and the longest utility call; ``None`` turns it off.
    """

    handshake_address: str = DEFAULT_HANDSHAKE_ADDRESS
    engine_count: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    engine_start_index: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    advertised_host: str = "127.0.0.1"
    input_address: str | None = None
    output_address: str | None = None
    bootstrapped: bool = False
    client_index: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    ready_timeout: float = attrs.field(default=600.0, validator=_positive)
    vocab_size: int | None = None
    max_logprobs: int = 20
    max_message_size: int | None = DEFAULT_MAX_MESSAGE_SIZE
    liveness_interval: float | None = 10.0
    liveness_timeout: float = attrs.field(default=60.0, validator=_positive)
    disconnect_grace: float = attrs.field(default=2.0, validator=_positive)
    heartbeat_interval: float | None = 1.0
    heartbeat_timeout: float = attrs.field(default=3.0, validator=_positive)
    check_version: bool = True

    def __attrs_post_init__(self) -> None:
        if self.bootstrapped and (self.input_address is None or self.output_address is None):
            raise ValueError("bootstrapped mode needs input_address and output_address")
        if self.engine_start_index + self.engine_count > 2**16:
            raise ValueError("engine ranks must fit in 2 bytes")
        if self.liveness_interval is not None and not self.liveness_interval > 0:
            raise ValueError("liveness_interval must be positive or None")
        if self.heartbeat_interval is not None and not self.heartbeat_interval > 0:
            raise ValueError("heartbeat_interval must be positive or None")

    @property
    def engine_ranks(self) -> range:
        return range(self.engine_start_index, self.engine_start_index + self.engine_count)
