"""The engine-core client's configuration: a transport that is one of two modes, and health
and routing as sub-configs. A combination that used to be refused at run time either cannot
be built at all (the field is not there: ``TypeError``) or is refused when built with a
``ValueError`` naming the field. (Addresses: test_connect.py; listener fds:
test_several_front_ends.py; routing values: test_routing.py; ``last_engine_death``:
test_all_engines_die.py.)"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from anyio_genout import (
    BootstrappedTransport,
    EngineCoreClientConfig,
    HandshakeTransport,
    HealthConfig,
    RoutingConfig,
)
from anyio_genout.engine import DEFAULT_HANDSHAKE_ADDRESS
from anyio_genout.engine.handshake import serve_handshake

pytestmark = pytest.mark.anyio

INP, OUT = "tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"


def test_the_default_owns_the_handshake_at_vllms_default_port() -> None:
    config = EngineCoreClientConfig()
    assert config.transport == HandshakeTransport(DEFAULT_HANDSHAKE_ADDRESS)
    assert config.transport.address == "tcp://127.0.0.1:29550"
    assert config.transport.advertised_host == "127.0.0.1"
    assert config.health == HealthConfig() and config.routing == RoutingConfig()
    assert config.routing.mode == "load" and config.health.engine_failure == "engine"


def test_the_two_positional_shortcuts() -> None:
    assert HandshakeTransport("tcp://10.0.0.5:29550").address == "tcp://10.0.0.5:29550"
    assert RoutingConfig("prefix").mode == "prefix"
    with pytest.raises(TypeError):
        HealthConfig(10.0)  # type: ignore[misc]
    with pytest.raises(TypeError):
        BootstrappedTransport(INP, OUT)  # type: ignore[misc]


def test_a_changed_copy_keeps_the_rest() -> None:
    config = EngineCoreClientConfig(engine_count=2, health=HealthConfig(liveness_interval=None))
    changed = attrs.evolve(config, transport=BootstrappedTransport(input_address=INP,
                                                                   output_address=OUT))
    assert isinstance(changed.transport, BootstrappedTransport)
    assert changed.engine_count == 2 and changed.health.liveness_interval is None


# ---------------------------------------------------------------------- unbuildable


def test_bootstrapped_without_both_addresses_cannot_be_built() -> None:
    """Was: ``bootstrapped=True`` without addresses, refused at run time."""
    with pytest.raises(TypeError, match="output_address"):
        BootstrappedTransport(input_address=INP)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="input_address None: not a string but NoneType"):
        BootstrappedTransport(input_address=None, output_address=OUT)  # type: ignore[arg-type]


def test_a_listener_fd_cannot_go_with_the_handshake() -> None:
    """Was: a listener fd without bootstrapped mode (never used so, silently bound)."""
    with pytest.raises(TypeError, match="input_listener_fd"):
        HandshakeTransport(input_listener_fd=3)  # type: ignore[call-arg]


def test_a_handshake_address_cannot_go_with_bootstrapped_mode() -> None:
    """Was: ``handshake_address`` with ``bootstrapped=True``, silently ignored."""
    with pytest.raises(TypeError, match="address"):
        BootstrappedTransport(address=DEFAULT_HANDSHAKE_ADDRESS,  # type: ignore[call-arg]
                              input_address=INP, output_address=OUT)


@pytest.mark.parametrize("old", [
    {"handshake_address": DEFAULT_HANDSHAKE_ADDRESS}, {"bootstrapped": True},
    {"liveness_interval": None}, {"engine_failure": "client"},
    {"prefix_memory_blocks": 8}, {"input_listener_fd": 3},
])
def test_the_old_flat_keywords_are_refused_not_dropped(old: dict[str, Any]) -> None:
    (name,) = old
    with pytest.raises(TypeError, match=name):
        EngineCoreClientConfig(**old)


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("transport", "tcp://127.0.0.1:29550", "a HandshakeTransport or BootstrappedTransport"),
    ("transport", HealthConfig(), "a HandshakeTransport or BootstrappedTransport"),
    ("health", {"liveness_interval": None}, "a HealthConfig"),
    ("routing", "prefix", "a RoutingConfig"),
])
def test_a_sub_config_of_the_wrong_type_is_refused_naming_the_field(
        field: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be {expected}, got "
                                         f"{type(value).__name__}$"):
        EngineCoreClientConfig(**{field: value})


# ---------------------------------------------------------------------- refused when built


def test_a_negative_listener_fd_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="output_listener_fd must be a file descriptor"):
        BootstrappedTransport(input_address=INP, output_address=OUT, output_listener_fd=-1)


def test_engine_ranks_fit_in_two_bytes() -> None:
    assert EngineCoreClientConfig(engine_start_index=65534, engine_count=2).engine_ranks \
        == range(65534, 65536)
    with pytest.raises(ValueError, match="engine ranks must fit in 2 bytes"):
        EngineCoreClientConfig(engine_start_index=65535, engine_count=2)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("liveness_interval", 0, "liveness_interval must be positive or None, got 0"),
    ("heartbeat_interval", -1.0, "heartbeat_interval must be positive or None, got -1.0"),
    ("liveness_timeout", 0.0, "liveness_timeout must be positive, got 0.0"),
    ("disconnect_grace", -2, "disconnect_grace must be positive, got -2"),
    ("heartbeat_timeout", "3", "heartbeat_timeout must be positive, got '3'"),
    ("engine_failure", "group", "engine_failure must be one of 'engine', 'client', got 'group'"),
])
def test_a_bad_health_value_is_refused_naming_the_field(field: str, value: object,
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        HealthConfig(**{field: value})


def test_health_checks_can_be_turned_off() -> None:
    health = HealthConfig(liveness_interval=None, heartbeat_interval=None)
    assert EngineCoreClientConfig(health=health).health.liveness_interval is None


async def test_serving_the_handshake_needs_a_handshake_transport() -> None:
    config = EngineCoreClientConfig(transport=BootstrappedTransport(input_address=INP,
                                                                    output_address=OUT))
    with pytest.raises(ValueError, match="needs a HandshakeTransport, got BootstrappedTransport"):
        await serve_handshake(config, [INP], [OUT])


@pytest.mark.parametrize("host", ["", "10.0.0.5 ", None])
def test_a_bad_advertised_host_is_refused_naming_it(host: object) -> None:
    with pytest.raises(ValueError, match="advertised_host must be a host name or address"):
        HandshakeTransport(advertised_host=host)  # type: ignore[arg-type]
