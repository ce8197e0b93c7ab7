"""Request migration (issue #16 part 2): a request whose engine dies moves to a live engine.

Four in-process mock engines behind one generate :class:`Client` with
``ClientConfig(migration_limit=...)`` run 400 greedy streams while engine 2 dies in each of
the ways an engine can (``ENGINE_CORE_DEAD``, its task cancelled with its sockets closed,
silence found by the liveness check): every stream finishes, with exactly the tokens (and
logprobs, and token-id stop sequences) of an undisturbed run, and no error; through a
:class:`TextClient` the text and stop strings are the undisturbed run's too. The mock
engines run with ``greedy_continuations`` so that, like a real model, a greedy prompt that
ends with tokens it generated continues that generation. A request that runs out of
migrations gets its one error; leaving the scope while the continuation waits for its
first output aborts it once, on the engine that runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import pytest
from prometheus_client import generate_latest

from anyio_genout import (
    Client,
    EngineDeadError,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TextClient,
    TextRequest,
)
from anyio_genout.mock import MockFaults, greedy_tokens, sampled_tokens
from tests.cluster import MockCluster, generate_client
from tests.faults.support import generate_request
from tests.faults.test_engine_failure_per_engine import (
    ENGINES,
    VICTIM,
    WAYS,
    settings,
)
from tests.support import wait_until
from tests.text.client_support import corpus, tokenizer

pytestmark = pytest.mark.anyio

STREAMS = 400
#: Mock engines continue greedy prompts that end with up to this many generated tokens.
MOCK = {"greedy_continuations": 128}


@attrs.define
class Outcome:
    first_engine: int
    engine: int = -1
    tokens: list[int] = attrs.Factory(list)
    logprob_ids: list[list[int]] = attrs.Factory(list)
    finish: FinishReason | None = None
    request_id: set[str] = attrs.Factory(set)
    prompt: tuple[int, ...] | None = None
    migrations: int = 0
    engine_request_id: str = ""
    error: BaseException | None = None


def _requests(count: int) -> list[GenerateRequest]:
    """Greedy streams, mostly short; every 50th streams across the death; every 7th asks
    for logprobs; every 25th has a token-id stop sequence it will meet late (token 70: late
    enough that the victim's are still running when it dies, on a loaded machine too)."""
    requests = []
    for i in range(count):
        prompt = (1 + i, 2 + i % 7, 3)
        max_tokens = 80 if i % 50 == 0 else 6 + i % 10
        params: dict[str, Any] = {}
        if i % 7 == 0:
            params["logprobs"] = 2
        if i % 25 == 0:
            late = greedy_tokens(prompt, 80)[70:72]
            params["stop_token_sequences"] = ((99999,), tuple(late))
            max_tokens = 100
        requests.append(generate_request(f"w-{i}", prompt=prompt, max_tokens=max_tokens,
                                         **params))
    return requests


WAVE = _requests(STREAMS)
_REFERENCE: dict[str, Outcome] = {}


async def run_wave(client: Client, requests: Sequence[GenerateRequest],
                   started: anyio.Event | None = None) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}

    async def one(request: GenerateRequest) -> None:
        async with client.generate(request) as stream:
            outcome = outcomes[request.request_id] = Outcome(stream.engine_index)
            try:
                async for out in stream:
                    outcome.tokens.extend(out.token_ids)
                    outcome.request_id.add(out.request_id)
                    if out.prompt_info is not None:
                        assert outcome.prompt is None  # once, from the first output
                        outcome.prompt = out.prompt_token_ids
                    if out.logprobs is not None:
                        outcome.logprob_ids.extend(out.logprobs.token_ids.tolist())
                    outcome.finish = out.finish_reason
            except EngineDeadError as exc:
                outcome.error = exc
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            outcome.engine = stream.engine_index
            outcome.migrations = stream.migrations
            outcome.engine_request_id = stream.engine_request_id

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            for request in requests:
                tg.start_soon(one, request)
            if started is not None:
                started.set()
    return outcomes


async def reference() -> dict[str, Outcome]:
    """An undisturbed run of the wave (greedy: the same on every backend), computed once."""
    if not _REFERENCE:
        async with generate_client(**settings(health={"liveness_interval": None}, mock=MOCK)) as (
                _, undisturbed):
            wave = await run_wave(undisturbed.front, WAVE)
        assert all(o.error is None and o.migrations == 0 for o in wave.values())
        # The late token-id stop sequences are met (the mock's own stops never are).
        assert all(isinstance(wave[f"w-{i}"].finish.stop_reason, tuple)  # type: ignore[union-attr]
                   for i in range(0, STREAMS, 25))
        _REFERENCE.update(wave)
    return _REFERENCE


def migrations_total(client: Client) -> dict[str, float]:
    text = generate_latest(client.metrics.registry).decode()
    return {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("anyio_genout:request_migrations_total{")}


@pytest.mark.parametrize("way", list(WAYS))
async def test_with_migration_every_stream_finishes_as_if_undisturbed(way: str) -> None:
    expected = await reference()
    faults, kill, _message, health = WAYS[way]
    async with generate_client(**settings(faults, mock=MOCK, generate={"migration_limit": 2},
                                          health=health)) as (_, c):
        client = c.front
        wave: dict[str, Outcome] = {}
        async with anyio.create_task_group() as tg:
            started = anyio.Event()

            async def streams() -> None:
                wave.update(await run_wave(client, WAVE, started))

            tg.start_soon(streams)
            await started.wait()
            await kill(c)
        assert len(wave) == STREAMS
        moved = {rid: o for rid, o in wave.items() if o.migrations}
        assert moved, "the victim died with no request in flight"
        for rid, outcome in wave.items():
            want = expected[rid]
            # No error, no gap, no duplicate: the undisturbed run's tokens, logprobs, end.
            assert outcome.error is None, (rid, outcome.error)
            assert outcome.tokens == want.tokens, rid
            assert outcome.logprob_ids == want.logprob_ids, rid
            assert outcome.finish == want.finish, rid
            # The stream's own id on every output, the original prompt once.
            assert len(outcome.request_id) == 1, rid
            assert outcome.prompt == want.prompt == tuple(WAVE[int(rid[2:])].prompt_token_ids)
        for outcome in moved.values():
            assert outcome.first_engine == VICTIM and outcome.migrations == 1
            assert outcome.engine != VICTIM
        # Token-id stop sequences met after a move (the stop sequence's state moved along):
        # every one that started on the victim moved (it needs 70 steps; the victim dies or
        # goes silent long before), and its tokens above are the undisturbed run's. Which
        # requests the victim gets is the router's choice: some runs give it none of them.
        stops_on_victim = [rid for rid, o in wave.items()
                           if int(rid[2:]) % 25 == 0 and o.first_engine == VICTIM]
        assert all(rid in moved for rid in stops_on_victim), stops_on_victim
        assert migrations_total(client) == {str(VICTIM): float(len(moved))}
        assert client.metrics.migrations == {VICTIM: len(moved)}
        assert client.engine.in_flight == 0
        # The only ABORTs on the live engines free the streams that met a stop sequence, once
        # each, by the id the engine knew; the dead engine got none for a moved request.
        matched = {o.engine_request_id for o in wave.values()
                   if o.finish is not None and isinstance(o.finish.stop_reason, tuple)}
        for e in range(ENGINES):
            aborted = c.engines[e].aborted_ids
            assert len(aborted) == len(set(aborted)) and set(aborted) <= matched, e
        assert not {o.engine_request_id for o in moved.values()} & set(
            c.engines[VICTIM].aborted_ids)


def kill_now(c: MockCluster, rank: int) -> None:
    """Stop engine ``rank`` (its sockets close) and tell the client at once, as a process
    watcher does (``engines.on_exit(client.engine.fail)``), instead of waiting for the
    disconnect probe."""
    c.scopes[rank].cancel()
    c.client.fail(EngineDeadError(f"engine {rank} exited (test)", ranks=(rank,)))


async def _one_long_stream(c: MockCluster, request: GenerateRequest, kills: int
                           ) -> tuple[list[int], BaseException | None, list[int]]:
    """One stream; each time it has moved as often as engines were killed so far and got
    3 more tokens, the engine running it is killed, ``kills`` times. Returns its tokens,
    its one error, and the engines killed."""
    tokens: list[int] = []
    error: BaseException | None = None
    killed: list[int] = []
    async with anyio.create_task_group() as tg, c.front.generate(request) as stream:
        async def killer() -> None:
            for _ in range(kills):
                await wait_until(lambda: stream.migrations == len(killed)
                                 and len(tokens) >= 3 * (len(killed) + 1))
                killed.append(stream.engine_index)
                kill_now(c, stream.engine_index)

        tg.start_soon(killer)
        try:
            async for out in stream:
                tokens.extend(out.token_ids)
        except EngineDeadError as exc:
            error = exc
        with pytest.raises(StopAsyncIteration):  # one error, then the end
            await stream.__anext__()
    return tokens, error, killed


async def test_a_request_out_of_migrations_gets_its_one_error() -> None:
    request = generate_request("long", prompt=(5, 6, 7), max_tokens=40)
    want = greedy_tokens((5, 6, 7), 40)
    async with generate_client(**settings(mock=MOCK, generate={"migration_limit": 1},
                                          health={"liveness_interval": None})) as (_, c):
        tokens, error, killed = await _one_long_stream(c, request, kills=2)
        # Moved once (no gap, no duplicate), then its second engine's death surfaced.
        assert isinstance(error, EngineDeadError) and error.ranks == (killed[1],)
        assert tokens == want[:len(tokens)] and len(tokens) >= 6
        assert c.front.metrics.migrations == {killed[0]: 1}
        assert c.client.is_healthy and c.client.in_flight == 0
    async with generate_client(**settings(mock=MOCK, generate={"migration_limit": 2},
                                          health={"liveness_interval": None})) as (_, c):
        tokens, error, killed = await _one_long_stream(c, request, kills=2)
        assert error is None and tokens == want  # two moves allowed: it finishes
        assert c.front.metrics.migrations == {killed[0]: 1, killed[1]: 1}


async def test_a_seeded_request_moves_but_its_generator_restarts() -> None:
    # As in vLLM, the continuation's sampling starts afresh from the seed: the tokens after
    # the move are the seeded stream of prompt + delivered tokens, not the undisturbed run's.
    prompt = [5, 6, 7]
    request = GenerateRequest(request_id="seeded", prompt_token_ids=prompt,
                              sampling_params=SamplingParams(temperature=1.0, seed=7,
                                                             max_tokens=40))
    undisturbed = sampled_tokens(prompt, 40, seed=7)
    async with generate_client(**settings(mock=MOCK, generate={"migration_limit": 1},
                                          health={"liveness_interval": None})) as (_, c):
        tokens, error, _killed = await _one_long_stream(c, request, kills=1)
    assert error is None and len(tokens) == 40 and tokens != undisturbed
    moved_at = [k for k in range(3, 40) if tokens == undisturbed[:k] + sampled_tokens(
        prompt + undisturbed[:k], 40 - k, seed=7)]
    assert len(moved_at) == 1, moved_at


async def test_pinned_requests_are_not_migrated() -> None:
    async with generate_client(**settings(MockFaults(dead_after_steps=3), mock=MOCK,
                                          generate={"migration_limit": 3},
                                          health={"liveness_interval": None})) as (_, c):
        pinned = attrs.evolve(generate_request("pinned", max_tokens=80),
                              data_parallel_rank=VICTIM)
        wave = await run_wave(c.front, [pinned])
        error = wave["pinned"].error
        assert isinstance(error, EngineDeadError) and error.ranks == (VICTIM,)
        assert wave["pinned"].migrations == 0 and c.front.metrics.migrations == {}


async def test_leaving_the_scope_mid_migration_aborts_once_on_the_new_engine() -> None:
    async with generate_client(**settings(mock=MOCK, generate={"migration_limit": 1},
                                          health={"liveness_interval": None})) as (_, c):
        client, engine = c.front, c.client
        tokens: list[int] = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()
                holder: list[Any] = []

                async def consumer() -> None:
                    with scope:
                        async with client.generate(
                                generate_request("leaver", max_tokens=300)) as stream:
                            holder.append(stream)
                            async for out in stream:
                                tokens.extend(out.token_ids)

                tg.start_soon(consumer)
                await wait_until(lambda: len(tokens) >= 3)
                stream = holder[0]
                first = stream.engine_index
                # The engines left alive schedule nothing: the continuation's first output
                # will not come while the scope is left.
                await engine.call_utility("pause_scheduler", "keep", False)
                kill_now(c, first)
                await wait_until(lambda: stream.migrations == 1)
                new_engine, new_id = stream.engine_index, stream.engine_request_id
                assert new_engine != first and new_id.startswith(f"{stream.request_id}-m1-")
                await anyio.sleep(0.05)
                before = len(tokens)
                scope.cancel()
        assert len(tokens) == before
        await wait_until(lambda: new_id in c.engines[new_engine].aborted_ids)
        await anyio.sleep(0.05)
        everywhere = [rid for e in range(ENGINES) for rid in c.engines[e].aborted_ids]
        assert everywhere == [new_id]  # once, on the engine that then ran it
        assert engine.in_flight == 0


async def test_client_abort_by_external_id_reaches_the_continuation() -> None:
    async with generate_client(**settings(mock=MOCK, generate={"migration_limit": 1},
                                          health={"liveness_interval": None})) as (_, c):
        client = c.front
        finish: list[FinishReason | None] = []
        with anyio.fail_after(10):
            async with client.generate(generate_request("ext", max_tokens=300)) as stream:
                async for out in stream:
                    if out.finish_reason is not None:
                        finish.append(out.finish_reason)
                    elif stream.migrations == 0 and len(out.token_ids) and stream.engine_index \
                            in client.engine.live_engines:
                        kill_now(c, stream.engine_index)
                    elif stream.migrations == 1:
                        await client.abort(["ext"])
        assert finish == [FinishReason.ABORT]
        new_id = stream.engine_request_id
        assert "-m1-" in new_id
        new_engine = c.engines[stream.engine_index]
        await wait_until(lambda: new_engine.aborted_ids)  # the ABORT frame is on its way
        assert new_engine.aborted_ids == [new_id]
        assert client.inflight.all_internal_ids() == []


# ---------------------------------------------------------------------- through TextClient

TEXT_STREAMS = 60


def _text_requests() -> list[TextRequest]:
    """Greedy text streams of corpus prompts; every 3rd has a stop string it meets late."""
    ids = corpus()
    requests = []
    for i in range(TEXT_STREAMS):
        prompt = list(ids[7 * i:7 * i + 4])
        stop: tuple[str, ...] = ()
        if i % 3 == 0:
            later = tokenizer().decode(greedy_tokens(prompt, 40, corpus=ids)[25:40])
            words = [w for w in later.split() if len(w) > 2]
            if words:
                stop = (words[len(words) // 2],)
        requests.append(TextRequest(
            request_id=f"t-{i}", prompt_token_ids=prompt, stop=stop,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=40)))
    return requests


TEXT_WAVE = _text_requests()
_TEXT_REFERENCE: dict[str, tuple[str, list[int], FinishReason | None]] = {}


async def run_text_wave(text: TextClient, started: anyio.Event | None = None
                        ) -> dict[str, tuple[str, list[int], FinishReason | None]]:
    results: dict[str, tuple[str, list[int], FinishReason | None]] = {}

    async def one(request: TextRequest) -> None:
        async with text.generate(request) as stream:
            collected = await stream.collect_text()
        results[request.request_id] = (collected.text, list(collected.token_ids),
                                       collected.finish_reason)

    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            for request in TEXT_WAVE:
                tg.start_soon(one, request)
            if started is not None:
                started.set()
    return results


@pytest.mark.parametrize("way", ["sentinel"])
async def test_text_and_stop_strings_are_seamless_across_a_migration(way: str) -> None:
    faults, kill, _message, health = WAYS[way]
    mock = {**MOCK, "corpus_token_ids": corpus()}
    if not _TEXT_REFERENCE:
        async with generate_client(**settings(health={"liveness_interval": None}, mock=mock)) as (
                _, undisturbed):
            _TEXT_REFERENCE.update(await run_text_wave(TextClient(undisturbed.front,
                                                                  tokenizer())))
    expected = _TEXT_REFERENCE
    stopped = [rid for rid, (_, _, finish) in expected.items()
               if finish is not None and isinstance(finish.stop_reason, str)]
    assert len(stopped) >= 10  # the stop strings are met (late) in the undisturbed run
    async with generate_client(**settings(faults, mock=mock, generate={"migration_limit": 1},
                                          health=health)) as (_, c):
        results: dict[str, tuple[str, list[int], FinishReason | None]] = {}
        async with anyio.create_task_group() as tg:
            started = anyio.Event()

            async def streams() -> None:
                results.update(await run_text_wave(TextClient(c.front, tokenizer()),
                                                   started))

            tg.start_soon(streams)
            await started.wait()
            await kill(c)
        moved = c.front.metrics.migrations.get(VICTIM, 0)
        assert moved >= 5
        assert results == expected
        # A stop string matched after a move freed the request on its new engine, once.
        aborted = [rid for e in range(ENGINES) if e != VICTIM
                   for rid in c.engines[e].aborted_ids]
        assert len(aborted) == len(set(aborted))
        assert any("-m1-" in rid for rid in aborted)
        assert not any("-m1-" in rid for rid in c.engines[VICTIM].aborted_ids)
