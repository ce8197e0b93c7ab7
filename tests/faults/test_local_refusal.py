"""Requests that would kill a real engine never leave the client.

A real vLLM 0.32 engine dies (ENGINE_CORE_DEAD) on a duplicate in-flight request id and on an
out-of-vocabulary token id, taking every other request with it; so does the mock. The
client refuses both locally, before any I/O, and the engine (and everyone else) lives on.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from anyio_genout import (
    DuplicateRequestIdError,
    EngineDeadError,
    InvalidRequestError,
    collect_output,
)
from anyio_genout.generate import FinishReasonKind

from .support import drain, engine_request, generate_client, generate_request, mock_cluster

pytestmark = pytest.mark.anyio

VOCAB = 1000


async def test_duplicate_in_flight_id_is_refused_locally() -> None:
    async with generate_client(randomize_request_ids=False) as (client, cluster):
        async with client.generate(generate_request("dup", max_tokens=50)) as first:
            with pytest.raises(DuplicateRequestIdError, match="dup"):
                async with client.generate(generate_request("dup")):
                    pytest.fail("a duplicate was sent")  # pragma: no cover
            result = await collect_output(first)
        assert result.finish_reason is not None
        assert result.finish_reason.kind is FinishReasonKind.LENGTH
        assert cluster.engine.added_ids == ["dup"] and not cluster.engine.dead
        assert len(client.inflight) == 0 and cluster.client.in_flight == 0
        # Once finished, the id is free again.
        async with client.generate(generate_request("dup", max_tokens=2)) as again:
            assert (await collect_output(again)).finish_reason is not None


async def test_duplicate_id_on_the_raw_client_is_refused_locally() -> None:
    async with mock_cluster() as cluster:
        client = cluster.client
        async with client.call(engine_request("dup", max_tokens=20)) as stream:
            with pytest.raises(DuplicateRequestIdError):
                async with client.call(engine_request("dup")):
                    pytest.fail("a duplicate was sent")  # pragma: no cover
            items, error = await drain(stream)
        assert error is None and items[-1].output.finished
        assert cluster.engine.added_ids == ["dup"] and not cluster.engine.dead


@pytest.mark.parametrize("where", ["client", "engine"])
async def test_out_of_vocabulary_prompt_token_is_refused_locally(where: str) -> None:
    settings: dict[str, Any] = {"client_vocab_size" if where == "client" else "vocab_size": VOCAB}
    async with generate_client(mock={"vocab_size": VOCAB}, **settings) as (client, cluster):
        assert (client.config.vocab_size, cluster.client.config.vocab_size) == (
            (VOCAB, None) if where == "client" else (None, VOCAB))
        async with client.generate(generate_request("ok", max_tokens=30)) as other:
            with pytest.raises(InvalidRequestError) as info:
                async with client.generate(generate_request("bad", prompt=[1, 2, VOCAB + 7])):
                    pytest.fail("an out-of-vocabulary prompt was sent")  # pragma: no cover
            assert info.value.field == "prompt_token_ids[2]"
            assert str(VOCAB + 7) in str(info.value)
            with pytest.raises(InvalidRequestError) as info:
                async with client.generate(generate_request("bad-stop",
                                                            stop_token_ids=[VOCAB])):
                    pytest.fail("an out-of-vocabulary stop token was sent")  # pragma: no cover
            assert "stop_token_ids[0]" in info.value.field
            result = await collect_output(other)
        assert result.finish_reason is not None
        assert not cluster.engine.dead and cluster.engine.errors == []
        assert [rid.split("-")[0] for rid in cluster.engine.added_ids] == ["ok"]
        assert len(client.inflight) == 0


async def test_without_vocab_size_an_oov_token_kills_the_engine_and_every_stream() -> None:
    """Why the check matters: the engine dies and takes the innocent requests along; each
    still ends with exactly one error, nothing hangs."""
    # Paced steps: the innocent requests (1000 tokens) must still be running when the bad
    # one arrives, even on a loaded machine.
    async with generate_client(mock={"vocab_size": VOCAB, "step_time": 0.002}) as (
            client, cluster):
        errors: list[BaseException | None] = []

        async def innocent(i: int) -> None:
            async with client.generate(generate_request(f"ok{i}", max_tokens=1000)) as s:
                errors.append((await drain(s))[1])

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(innocent, i)
                await anyio.sleep(0.05)
                async with client.generate(generate_request("bad", prompt=[VOCAB + 7])) as s:
                    errors.append((await drain(s))[1])
        assert cluster.engine.dead and "out of vocabulary" in cluster.engine.errors[-1]
        assert len(errors) == 6 and all(isinstance(e, EngineDeadError) for e in errors)
