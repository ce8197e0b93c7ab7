"""The error tree says what a user can rely on: whether the client survives is the class.

docs/errors.md ("What you can rely on"): every error is exactly one of a ``UsageError``
(nothing sent), a ``ClientUnhealthyError`` (sticky: the client is unhealthy for good), a
``RequestFailedError`` (one request), a utility-call error (one call) or a
``HandshakeError`` (``Client.connect`` only). The first tests pin each public class to its
family; the others check against real ZeroMQ engines that the class tells the truth: a
``RequestFailedError`` leaves the client healthy and the other streams running, a
``ClientUnhealthyError`` fails every stream and every later call.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable

import pytest

from anyio_genout import (
    ChatTemplateError,
    ClientClosedError,
    ClientUnhealthyError,
    DuplicateRequestIdError,
    EngineDeadError,
    GenoutError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompleteStreamError,
    InconsistentUtilityResultsError,
    InvalidRequestError,
    ModelFolderError,
    OperationalError,
    ProtocolError,
    RequestFailedError,
    RequestStreamClosedError,
    SamplingMaskMismatchError,
    TransportError,
    UnsupportedVersionError,
    UsageError,
    UtilityCallError,
)
from anyio_genout.protocol import ENGINE_CORE_DEAD
from anyio_genout.vllm import EngineProcessExitedError
from tests.engine.fake import FakeEngine
from tests.generate.support import LENGTH, generate_cluster, mask, output, request

#: The families a user decides by, and what each promises (docs/errors.md).
FAMILIES: dict[type[GenoutError], str] = {
    UsageError: "nothing was sent; the client is unaffected",
    ClientUnhealthyError: "sticky: the client is unhealthy for good",
    RequestFailedError: "one request failed; the client stays healthy",
    UtilityCallError: "one utility call failed; the client stays healthy",
    InconsistentUtilityResultsError: "one utility call failed; the client stays healthy",
    HandshakeError: "Client.connect only: there is no client",
}

#: Every public error class, with the family it belongs to.
EXPECTED: dict[type[GenoutError], type[GenoutError]] = {
    InvalidRequestError: UsageError,
    DuplicateRequestIdError: UsageError,
    ModelFolderError: UsageError,
    ChatTemplateError: UsageError,
    EngineDeadError: ClientUnhealthyError,
    EngineProcessExitedError: ClientUnhealthyError,
    ProtocolError: ClientUnhealthyError,
    TransportError: ClientUnhealthyError,
    ClientClosedError: ClientUnhealthyError,
    SamplingMaskMismatchError: RequestFailedError,
    IncompleteStreamError: RequestFailedError,
    RequestStreamClosedError: RequestFailedError,
    UtilityCallError: UtilityCallError,
    InconsistentUtilityResultsError: InconsistentUtilityResultsError,
    HandshakeError: HandshakeError,
    HandshakeTimeoutError: HandshakeError,
    UnsupportedVersionError: HandshakeError,
}

#: Abstract groupings: a base that is no family of its own.
GROUPINGS = {GenoutError, OperationalError}

PUBLIC_MODULES = ("anyio_genout", "anyio_genout.errors", "anyio_genout.metrics",
                  "anyio_genout.mock", "anyio_genout.vllm")


def public_error_classes() -> set[type[GenoutError]]:
    found: set[type[GenoutError]] = set()
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for attribute in module.__all__:
            value = getattr(module, attribute)
            if inspect.isclass(value) and issubclass(value, GenoutError):
                found.add(value)
    return found


def test_every_public_error_is_in_the_table() -> None:
    """A new error class must be given a family here (and in docs/errors.md)."""
    assert public_error_classes() == set(EXPECTED) | set(FAMILIES) | GROUPINGS


@pytest.mark.parametrize("error", list(EXPECTED), ids=lambda e: e.__name__)
def test_each_error_is_in_exactly_one_family(error: type[GenoutError]) -> None:
    families = [family for family in FAMILIES if issubclass(error, family)]
    assert families == [EXPECTED[error]], (error, families)
    assert issubclass(error, GenoutError)
    assert issubclass(error, UsageError) != issubclass(error, OperationalError)


def test_the_per_request_errors_are_not_caught_as_sticky_ones() -> None:
    """``except ProtocolError: reconnect`` must not fire for one bad output."""
    for error in (SamplingMaskMismatchError, IncompleteStreamError, RequestStreamClosedError):
        assert not issubclass(error, ProtocolError | ClientUnhealthyError), error
    # The engine closing a stream is the engine-made case of an incomplete stream.
    assert issubclass(RequestStreamClosedError, IncompleteStreamError)


def test_the_constructors_and_attributes_are_as_documented() -> None:
    closed = RequestStreamClosedError("r-1")
    assert closed.request_id == "r-1"
    assert str(closed) == "request 'r-1': stream closed by the engine without a final output"
    # Sticky errors are raised again as fresh copies built from their message.
    for error in (EngineDeadError, ProtocolError, TransportError, ClientClosedError):
        assert str(error(str(error("boom")))) == "boom"
    assert issubclass(HandshakeTimeoutError, TimeoutError)
    assert issubclass(InvalidRequestError, ValueError)


# ------------------------------------------------- behaviour: the class tells the truth

async def _sampling_mask_mismatch(engine: FakeEngine, internal: str) -> None:
    await engine.send([output(internal, [1, 2], new_sampling_mask=mask([1, 5]))])


async def _finished_without_output(engine: FakeEngine, internal: str) -> None:
    await engine.send([], finished_requests=frozenset({internal}))


PER_REQUEST: dict[str, tuple[Callable[[FakeEngine, str], Awaitable[None]],
                             type[RequestFailedError]]] = {
    "sampling mask mismatch": (_sampling_mask_mismatch, SamplingMaskMismatchError),
    "finished without output": (_finished_without_output, RequestStreamClosedError),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(PER_REQUEST))
async def test_a_per_request_error_leaves_the_client_healthy_and_other_streams_running(
        case: str) -> None:
    fault, expected = PER_REQUEST[case]
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("bad")) as bad, \
                client.generate(request("good")) as good:
            bad_id = (await engine.receive_add()).request.request_id
            good_id = (await engine.receive_add()).request.request_id
            await engine.send([output(good_id, [7])])
            assert (await good.__anext__()).token_ids == [7]
            await fault(engine, bad_id)
            with pytest.raises(RequestFailedError) as info:
                await bad.__anext__()
            assert type(info.value) is expected
            assert not isinstance(info.value, ClientUnhealthyError)
            assert client.engine.is_healthy
            assert client.engine.health_error is None
            # The other stream runs on to its end.
            await engine.send([output(good_id, [8])])
            await engine.send([output(good_id, [9], LENGTH)])
            # Coalesced or not, the tokens that followed and the end.
            assert [t async for o in good for t in o.token_ids] == [8, 9]
        # And the client takes new requests.
        async with client.generate(request("after")) as after:
            after_id = (await engine.receive_add()).request.request_id
            await engine.send([output(after_id, [3], LENGTH)])
            assert [o.token_ids async for o in after] == [[3]]
        assert client.engine.is_healthy


STICKY: dict[str, tuple[list[bytes], type[ClientUnhealthyError]]] = {
    "ENGINE_CORE_DEAD": ([ENGINE_CORE_DEAD], EngineDeadError),
    "undecodable output": ([b"\xc1"], ProtocolError),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(STICKY))
async def test_a_sticky_error_fails_every_stream_and_every_later_call(case: str) -> None:
    frames, expected = STICKY[case]
    async with generate_cluster() as (client, (engine,)):
        async with client.generate(request("one")) as one, \
                client.generate(request("two")) as two:
            await engine.receive_add()
            await engine.receive_add()
            await engine.send_raw(frames)
            for stream in (one, two):
                with pytest.raises(ClientUnhealthyError) as info:
                    await stream.__anext__()
                assert type(info.value) is expected
        assert not client.engine.is_healthy
        assert isinstance(client.engine.health_error, expected)
        if expected is ProtocolError:  # the engine lives: the failed requests are aborted
            abort = await engine.receive_abort()
            assert sorted(r.rsplit("-", 1)[0] for r in abort.request_ids) == ["one", "two"]
        # Every later call raises it at once, before anything is sent.
        with pytest.raises(expected):
            async with client.generate(request("later")):
                pytest.fail("entered an unhealthy client")  # pragma: no cover
        with pytest.raises(expected):
            await client.engine.call_utility("is_sleeping")
        await engine.expect_nothing(0.1)

