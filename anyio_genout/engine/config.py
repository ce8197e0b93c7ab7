"""How an :class:`~anyio_genout.EngineCoreClient` finds and talks to its engines."""

from __future__ import annotations

from typing import Any, Final, Literal

import attrs

from ..transport import DEFAULT_MAX_MESSAGE_SIZE
from .routing import DEFAULT_IMBALANCE_THRESHOLD, DEFAULT_MEMORY_BLOCKS, ROUTING_MODES

__all__ = ["ADDRESS_FORMS", "DEFAULT_HANDSHAKE_ADDRESS", "EngineCoreClientConfig"]

#: vLLM's default ``--data-parallel-rpc-port`` on loopback.
DEFAULT_HANDSHAKE_ADDRESS: Final = "tcp://127.0.0.1:29550"


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def _routing_mode(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in ROUTING_MODES:
        raise ValueError(f"routing must be one of {', '.join(map(repr, ROUTING_MODES))}, "
                         f"got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{attribute.name} must be a number >= 0, got {value!r}")


def _at_least_one(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


#: The address forms the client binds, with examples, for error messages.
ADDRESS_FORMS: Final = ("tcp://HOST:PORT (e.g. tcp://127.0.0.1:29550) or ipc://PATH "
                        "(e.g. ipc:///tmp/genout-engine.sock)")
#: Bytes in a Unix socket path at most (``sun_path`` on Linux, less its terminating NUL).
_MAX_IPC_PATH: Final = 107


def _address(instance: EngineCoreClientConfig, attribute: attrs.Attribute[Any],
             value: object) -> None:
    """Refuse an address ZeroMQ would not bind, or that no engine could reach, naming the
    field and showing the expected form (before anything is bound or awaited)."""
    if value is None:
        return
    field = attribute.name
    # Engines must know the port of what they dial: the handshake socket always, the input
    # and output sockets when they are given to the engines directly (bootstrapped).
    fixed_port = field == "handshake_address" or instance.bootstrapped
    if isinstance(value, str):
        problem = _address_problem(value, fixed_port=fixed_port)
    else:
        problem = f"not a string but {type(value).__name__}"
    if problem is not None:
        raise ValueError(f"{field} {value!r}: {problem}; expected {ADDRESS_FORMS}")


def _address_problem(address: str, *, fixed_port: bool) -> str | None:
    scheme, sep, rest = address.partition("://")
    if not sep:
        host, colon, port = address.rpartition(":")
        if colon and host and port.isdigit():
            return f"no scheme (did you mean 'tcp://{address}'?)"
        return "no scheme"
    if any(c.isspace() for c in address):
        return "it contains white space"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or "/" in rest or host.startswith("[") != host.endswith("]"):
            return "a tcp:// address is HOST:PORT"
        if ":" in host and not host.startswith("["):
            return f"an IPv6 host goes in brackets: tcp://[{host}]:{port}"
        if port in ("*", "0"):
            if fixed_port:
                return "engines must know this port, so it cannot be chosen at bind time"
            return None
        if not port.isdigit() or not 0 < int(port) < 65536:
            return f"port {port!r} is not a number from 1 to 65535"
        return None
    if scheme == "ipc":
        if not rest:
            return "an ipc:// address needs a path"
        if len(rest.encode()) > _MAX_IPC_PATH:
            return (f"the ipc:// path is {len(rest.encode())} bytes long; a Unix socket's "
                    f"path has at most {_MAX_IPC_PATH}")
        return None
    if scheme == "inproc":
        return ("inproc:// reaches only sockets of the same ZeroMQ context, and no engine "
                "shares the client's")
    return f"{scheme}:// is not a transport engines connect over"


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

    ``input_listener_fd`` / ``output_listener_fd``: a listening TCP socket already bound at
    ``input_address`` / ``output_address`` (inherited from a supervisor process, as vLLM's
    ``--api-server-count`` supervisor hands them to its API servers); the client's ZeroMQ
    socket adopts it (``ZMQ_USE_FD``) and owns it from then on. With several front-end
    processes on the same engines, each has its own pair and its own ``client_index``.

    Addresses are ``tcp://HOST:PORT`` or ``ipc://PATH``, checked here: a malformed one
    raises :class:`ValueError` naming the field and the expected form. A port engines must
    dial (the handshake socket's; bootstrapped, the input and output sockets' too) must be
    a fixed one, not ``*``.

    ``ready_timeout`` bounds the whole start-up (a real engine loads its model before READY,
    hence the 600 s default).

    Engines that die without saying so (``ENGINE_CORE_DEAD``) are found three ways, all on
    by default (docs/reliability.md has the measurements behind the defaults):

    * a connection to the input or output socket that closes (process killed, or dropped
      by the heartbeat below) starts a probe: every engine must answer a cheap utility
      call, and an engine whose connection is not back within ``disconnect_grace`` seconds
      and that did not answer is dead;
    * ``heartbeat_interval``: ZeroMQ pings every connection to the input socket that often
      (engines answer by themselves), and closes one that stays quiet for
      ``heartbeat_timeout`` seconds (a vanished host, a cut network); ``None`` turns
      heartbeats off;
    * ``liveness_interval``: every engine is asked a cheap utility call that often; one that
      does not answer within ``liveness_timeout`` is dead (an engine that is connected but
      hung or deaf). A utility call is answered between two engine steps, so the timeout
      must exceed the longest step and the longest utility call; ``None`` turns it off.

    ``engine_failure``: what one engine's death fails. ``"engine"`` (the default, right for
    independent data-parallel engines): only that engine's requests and utility calls, each
    with an :class:`~anyio_genout.EngineDeadError` naming it; it leaves the routing set and
    the client stays healthy while another engine lives. ``"client"``: the whole client
    (every request, every engine), for a data-parallel group whose engines must step
    together. Either way the last engine's death makes the client unhealthy, unless
    ``last_engine_death="wait"``.

    ``last_engine_death``: what the death of the last engine up does. ``"fail"`` (the
    default): the client fails as a whole (sticky :attr:`health_error`), as vLLM's front
    ends do; leave ``connect`` and connect again. ``"wait"`` (needs ``engine_failure=
    "engine"``; ``anyio-genout serve`` uses it): the client stays healthy with no engine up
    (``live_engines`` empty), every new request and utility call fails at once with an
    :class:`~anyio_genout.EngineDeadError` naming the engines down and why, and a restarted
    engine rejoins as when others live; how long to wait for one is the caller's choice
    (``serve --engine-rejoin-timeout``). docs/reliability.md, "When every engine dies".

    Routing (docs/routing.md), for requests without a ``data_parallel_rank``: ``routing``
    ``"load"`` (default) sends each to the least-loaded engine by vLLM's score (KV-usage
    penalty included); ``"prefix"`` to the engine expected to hold the longest cached prefix
    of its prompt, unless that engine's score exceeds the least-loaded one's by more than
    ``prefix_imbalance_threshold``; it remembers at most ``prefix_memory_blocks`` block
    hashes per engine. A bad value raises :class:`ValueError` naming the field.

    ``data_parallel_waves``: the engines are one data-parallel MoE group that steps in
    lockstep (vLLM's request waves, :mod:`.waves`): every request carries the group's
    ``current_wave``, a request while the group is paused first wakes the other engines
    (``START_DP_WAVE`` on the input socket), and the engines' ``wave_complete`` /
    ``start_wave`` messages on the output socket are followed instead of failing the
    client. Off by default (independent engines never send them).
    """

    handshake_address: str = attrs.field(default=DEFAULT_HANDSHAKE_ADDRESS, validator=_address)
    engine_count: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    engine_start_index: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    advertised_host: str = "127.0.0.1"
    input_address: str | None = attrs.field(default=None, validator=_address)
    output_address: str | None = attrs.field(default=None, validator=_address)
    bootstrapped: bool = False
    input_listener_fd: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.ge(0)))
    output_listener_fd: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(0)))
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
    engine_failure: Literal["engine", "client"] = attrs.field(
        default="engine", validator=attrs.validators.in_(("engine", "client")))
    routing: Literal["load", "prefix"] = attrs.field(default="load", validator=_routing_mode)
    prefix_imbalance_threshold: float = attrs.field(default=DEFAULT_IMBALANCE_THRESHOLD,
                                                    validator=_non_negative)
    prefix_memory_blocks: int = attrs.field(default=DEFAULT_MEMORY_BLOCKS,
                                            validator=_at_least_one)
    data_parallel_waves: bool = False
    last_engine_death: Literal["fail", "wait"] = attrs.field(
        default="fail", validator=attrs.validators.in_(("fail", "wait")))

    def __attrs_post_init__(self) -> None:
        if self.bootstrapped and (self.input_address is None or self.output_address is None):
            raise ValueError("bootstrapped mode needs input_address and output_address")
        for fd, address, name in ((self.input_listener_fd, self.input_address, "input"),
                                  (self.output_listener_fd, self.output_address, "output")):
            if fd is not None and (address is None or not address.startswith("tcp://")):
                raise ValueError(f"{name}_listener_fd needs the tcp:// {name}_address it "
                                 f"is bound at")
        if self.engine_start_index + self.engine_count > 2**16:
            raise ValueError("engine ranks must fit in 2 bytes")
        if self.liveness_interval is not None and not self.liveness_interval > 0:
            raise ValueError("liveness_interval must be positive or None")
        if self.heartbeat_interval is not None and not self.heartbeat_interval > 0:
            raise ValueError("heartbeat_interval must be positive or None")
        if self.last_engine_death == "wait" and self.engine_failure != "engine":
            raise ValueError('last_engine_death="wait" needs engine_failure="engine" (a '
                             'group whose first death fails the client has nothing to wait '
                             'for)')

    @property
    def engine_ranks(self) -> range:
        return range(self.engine_start_index, self.engine_start_index + self.engine_count)
