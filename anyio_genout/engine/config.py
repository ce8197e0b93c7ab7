"""How an :class:`~anyio_genout.EngineCoreClient` finds and talks to its engines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal, TypeAlias

import attrs

from ..transport import DEFAULT_MAX_MESSAGE_SIZE
from .routing import DEFAULT_IMBALANCE_THRESHOLD, DEFAULT_MEMORY_BLOCKS, ROUTING_MODES

__all__ = [
    "ADDRESS_FORMS", "DEFAULT_HANDSHAKE_ADDRESS", "BootstrappedTransport", "EngineCoreClientConfig",
    "HandshakeTransport", "HealthConfig", "RoutingConfig", "Transport",
]

#: vLLM's default ``--data-parallel-rpc-port`` on loopback.
DEFAULT_HANDSHAKE_ADDRESS: Final = "tcp://127.0.0.1:29550"


def _positive(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


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


def _address_field(*, fixed_port: bool) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A validator refusing an address ZeroMQ would not bind, or that no engine could reach,
    naming the field and showing the expected form (before anything is bound or awaited).
    ``fixed_port``: engines dial this socket, so they must know its port (no ``*``)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, str):
            problem = _address_problem(value, fixed_port=fixed_port)
        else:
            problem = f"not a string but {type(value).__name__}"
        if problem is not None:
            raise ValueError(f"{attribute.name} {value!r}: {problem}; expected {ADDRESS_FORMS}")

    return check


def _optional_address_field(*, fixed_port: bool
                            ) -> Callable[[object, attrs.Attribute[Any], object], None]:
    check = _address_field(fixed_port=fixed_port)

    def optional(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            check(instance, attribute, value)

    return optional


def _optional_fd(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ValueError(f"{attribute.name} must be a file descriptor (an integer >= 0) or "
                         f"None, got {value!r}")


def _positive_or_none(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not value > 0):
        raise ValueError(f"{attribute.name} must be positive or None, got {value!r}")


def _one_of(*choices: str) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of "
                             f"{', '.join(map(repr, choices))}, got {value!r}")

    return check


def _host(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(f"{attribute.name} must be a host name or address, got {value!r}")


@attrs.frozen
class HandshakeTransport:
    """The client owns the handshake (the default transport).

    The client binds a ROUTER at ``address``; engines started with ``vllm serve --headless
    --data-parallel-address H --data-parallel-rpc-port P`` dial it, and the client tells
    them where its input and output sockets are: bound on ``advertised_host`` (a port
    chosen at bind time), or at ``input_address`` / ``output_address`` when given
    (``ipc://`` works too; a ``*`` or 0 port is chosen at bind time, since the engines learn
    it from the handshake). ``address`` is engines' to dial, so its port is a fixed one.
    ``HandshakeTransport("tcp://10.0.0.5:29550")`` gives it positionally.
    """

    address: str = attrs.field(default=DEFAULT_HANDSHAKE_ADDRESS,
                               validator=_address_field(fixed_port=True))
    advertised_host: str = attrs.field(default="127.0.0.1", kw_only=True, validator=_host)
    input_address: str | None = attrs.field(default=None, kw_only=True,
                                            validator=_optional_address_field(fixed_port=False))
    output_address: str | None = attrs.field(
        default=None, kw_only=True, validator=_optional_address_field(fixed_port=False))


@attrs.frozen(kw_only=True)
class BootstrappedTransport:
    """No handshake: the engines are told the client's addresses some other way.

    Engines ``engine_start_index .. engine_start_index+engine_count-1`` connect to
    ``input_address`` and ``output_address`` directly and register on the input socket, so
    both are required and their ports fixed (not ``*``).

    ``input_listener_fd`` / ``output_listener_fd``: a listening TCP socket already bound at
    ``input_address`` / ``output_address`` (inherited from a supervisor process, as vLLM's
    ``--api-server-count`` supervisor hands them to its API servers); the client's ZeroMQ
    socket adopts it (``ZMQ_USE_FD``) and owns it from then on. Each needs its ``tcp://``
    address. With several front-end processes on the same engines, each has its own pair
    and its own ``client_index``.
    """

    input_address: str = attrs.field(validator=_address_field(fixed_port=True))
    output_address: str = attrs.field(validator=_address_field(fixed_port=True))
    input_listener_fd: int | None = attrs.field(default=None, validator=_optional_fd)
    output_listener_fd: int | None = attrs.field(default=None, validator=_optional_fd)

    def __attrs_post_init__(self) -> None:
        for fd, address, name in ((self.input_listener_fd, self.input_address, "input"),
                                  (self.output_listener_fd, self.output_address, "output")):
            if fd is not None and not address.startswith("tcp://"):
                raise ValueError(f"{name}_listener_fd needs the tcp:// {name}_address it "
                                 f"is bound at, got {address!r}")


@attrs.frozen(kw_only=True)
class HealthConfig:
    """How engines that die without saying so (``ENGINE_CORE_DEAD``) are found, and what
    a death fails.

    Three detectors, all on by default (docs/reliability.md has the measurements behind
    the defaults):

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

    A bad value raises :class:`ValueError` naming the field.
    """

    liveness_interval: float | None = attrs.field(default=10.0, validator=_positive_or_none)
    liveness_timeout: float = attrs.field(default=60.0, validator=_positive)
    disconnect_grace: float = attrs.field(default=2.0, validator=_positive)
    heartbeat_interval: float | None = attrs.field(default=1.0, validator=_positive_or_none)
    heartbeat_timeout: float = attrs.field(default=3.0, validator=_positive)
    engine_failure: Literal["engine", "client"] = attrs.field(
        default="engine", validator=_one_of("engine", "client"))
    last_engine_death: Literal["fail", "wait"] = attrs.field(
        default="fail", validator=_one_of("fail", "wait"))

    def __attrs_post_init__(self) -> None:
        if self.last_engine_death == "wait" and self.engine_failure != "engine":
            raise ValueError('last_engine_death="wait" needs engine_failure="engine" (a '
                             'group whose first death fails the client has nothing to wait '
                             'for)')


@attrs.frozen
class RoutingConfig:
    """How a request without a ``data_parallel_rank`` picks its engine (docs/routing.md).

    ``mode`` ``"load"`` (default) sends each to the least-loaded engine by vLLM's score
    (KV-usage penalty included); ``"prefix"`` to the engine expected to hold the longest
    cached prefix of its prompt, unless that engine's score exceeds the least-loaded one's
    by more than ``prefix_imbalance_threshold``; it remembers at most
    ``prefix_memory_blocks`` block hashes per engine. ``RoutingConfig("prefix")`` gives the
    mode positionally. A bad value raises :class:`ValueError` naming the field.
    """

    mode: Literal["load", "prefix"] = attrs.field(default="load", validator=_one_of(
        *ROUTING_MODES))
    prefix_imbalance_threshold: float = attrs.field(default=DEFAULT_IMBALANCE_THRESHOLD,
                                                    kw_only=True, validator=_non_negative)
    prefix_memory_blocks: int = attrs.field(default=DEFAULT_MEMORY_BLOCKS, kw_only=True,
                                            validator=_at_least_one)


#: The transport of an :class:`EngineCoreClientConfig`: one of the two modes, so settings
#: of both cannot be combined.
Transport: TypeAlias = HandshakeTransport | BootstrappedTransport


def _instance_of(*types: type) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, types):
            raise ValueError(f"{attribute.name} must be a "
                             f"{' or '.join(t.__name__ for t in types)}, "
                             f"got {type(value).__name__}")

    return check


@attrs.frozen(kw_only=True)
class EngineCoreClientConfig:
    """Connection settings of an :class:`~anyio_genout.EngineCoreClient`.

    ``transport``: how the engines find the client, one of two modes:
    :class:`HandshakeTransport` (the default: the client owns the handshake, engines dial
    its ``address``) or :class:`BootstrappedTransport` (engines connect to the given input
    and output addresses directly). ``health``: how engine deaths are found and what they
    fail (:class:`HealthConfig`); ``routing``: how requests pick an engine
    (:class:`RoutingConfig`).

    Engines ``engine_start_index .. engine_start_index+engine_count-1`` (their ranks, which
    fit in 2 bytes) are this client's.

    ``ready_timeout`` bounds the whole start-up (a real engine loads its model before READY,
    hence the 600 s default).

    ``data_parallel_waves``: the engines are one data-parallel MoE group that steps in
    lockstep (vLLM's request waves, :mod:`.waves`): every request carries the group's
    ``current_wave``, a request while the group is paused first wakes the other engines
    (``START_DP_WAVE`` on the input socket), and the engines' ``wave_complete`` /
    ``start_wave`` messages on the output socket are followed instead of failing the
    client. Off by default (independent engines never send them).
    """

    transport: Transport = attrs.field(
        factory=HandshakeTransport,
        validator=_instance_of(HandshakeTransport, BootstrappedTransport))
    health: HealthConfig = attrs.field(factory=HealthConfig,
                                       validator=_instance_of(HealthConfig))
    routing: RoutingConfig = attrs.field(factory=RoutingConfig,
                                         validator=_instance_of(RoutingConfig))
    engine_count: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    engine_start_index: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    client_index: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    ready_timeout: float = attrs.field(default=600.0, validator=_positive)
    vocab_size: int | None = None
    max_logprobs: int = 20
    max_message_size: int | None = DEFAULT_MAX_MESSAGE_SIZE
    check_version: bool = True
    data_parallel_waves: bool = False

    def __attrs_post_init__(self) -> None:
        if self.engine_start_index + self.engine_count > 2**16:
            raise ValueError("engine ranks must fit in 2 bytes")

    @property
    def engine_ranks(self) -> range:
        return range(self.engine_start_index, self.engine_start_index + self.engine_count)
