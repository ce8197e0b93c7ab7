"""The routers, pure (no sockets): vLLM's load score with its KV-usage penalty, prefix
affinity, the overload fallback, pinning, the memory bound, corrections from the engines'
cached-token counts, and the hash-chain / LRU invariants (hypothesis, derandomized)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anyio_genout import EngineCoreClientConfig, RoutingConfig, SamplingParams
from anyio_genout.engine.routing import (
    EngineLoad,
    LoadRouter,
    PrefixRouter,
    block_hashes,
    make_router,
)
from anyio_genout.protocol import EngineCoreRequest, LoRARequest

BS = 16


def req(prompt: Sequence[int], rid: str = "r", **kw: object) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt),
                             sampling_params=SamplingParams(max_tokens=4), arrival_time=0.0,
                             **kw)  # type: ignore[arg-type]


def loads(*scores: int) -> list[EngineLoad]:
    out = []
    for rank, in_flight in enumerate(scores):
        load = EngineLoad(rank)
        load.in_flight = in_flight
        out.append(load)
    return out


def prefix_router(engines: int = 4, *, gpu_blocks: int = 10_000, **kw: object) -> PrefixRouter:
    return PrefixRouter({r: BS for r in range(engines)}, {r: gpu_blocks for r in range(engines)},
                        **kw)  # type: ignore[arg-type]


def system(n: int, blocks: int = 4) -> list[int]:
    """System prompt ``n``: ``blocks`` whole blocks of its own tokens."""
    return [1000 * (n + 1) + i for i in range(blocks * BS)]


def user(n: int, length: int = 20) -> list[int]:
    return [50_000 + 100 * n + i for i in range(length)]


# ---------------------------------------------------------------------- load score


def test_load_score_is_vllms_with_the_kv_usage_penalty() -> None:
    load = EngineLoad(0)
    load.in_flight = 3
    assert load.score == 3  # no stats yet: what this client has in flight
    load.running, load.waiting = 4, 2
    assert load.score == 6  # max(in flight, running + waiting)
    load.kv_cache_usage = 0.5
    assert load.score == 6  # no penalty up to half usage
    load.kv_cache_usage = 1.0
    assert load.score == pytest.approx(6 + 2 * 6.0 * 0.5)  # waiting x 3 at full usage
    load.waiting = 0
    assert load.score == 4  # nothing waits: no penalty


def test_load_router_prefers_the_engine_whose_queue_is_not_kv_bound() -> None:
    # Same running + waiting; engine 0's cache is full, so its queue drains slowly.
    a, b = EngineLoad(0), EngineLoad(1)
    for load, usage in ((a, 0.95), (b, 0.2)):
        load.running, load.waiting, load.kv_cache_usage = 2, 4, usage
    assert LoadRouter().choose(req([1, 2]), [a, b], None)[0] == 1


def test_load_router_ties_go_to_the_first_and_pinning_wins() -> None:
    router = LoadRouter()
    assert router.choose(req([1]), loads(2, 1, 1), None) == (1, None)
    pinned = loads(0, 9)
    assert router.choose(req([1]), pinned, pinned[1]) == (1, None)
    assert (router.stats.by_load, router.stats.pinned) == (1, 1)


# ---------------------------------------------------------------------- prefix affinity


def test_requests_sharing_a_system_prompt_follow_it() -> None:
    router = prefix_router()
    engines = loads(0, 0, 0, 0)
    first = {}
    for n in range(4):  # four system prompts, spread by load as they are new
        rank, expected = router.choose(req(system(n) + user(n)), engines, None)
        assert expected == 0
        engines[rank].in_flight += 1
        first[n] = rank
    assert sorted(first.values()) == [0, 1, 2, 3]
    for n in range(4):  # later users of each prompt go where it is cached
        for u in range(3):
            rank, expected = router.choose(req(system(n) + user(10 + u)), engines, None)
            assert (rank, expected) == (first[n], 4)  # its 4 system blocks
            engines[rank].in_flight += 1
    assert router.stats.by_prefix == 12
    assert router.stats.by_load == 4


def test_longest_prefix_wins_and_ties_go_to_the_less_loaded() -> None:
    router = prefix_router(3)
    engines = loads(0, 0, 0)
    shared = system(0, blocks=2)
    router.choose(req(shared + user(1)), engines, engines[0])  # engine 0: 2 blocks
    router.choose(req(shared + system(1, blocks=2) + user(2)), engines, engines[1])  # 1: 4
    rank, expected = router.choose(req(shared + system(1, blocks=2) + user(3)), engines, None)
    assert (rank, expected) == (1, 4)
    router.choose(req(shared + user(4)), engines, engines[2])  # engine 2: the same 2 blocks
    engines[0].in_flight = 3
    rank, expected = router.choose(req(shared + user(5)), engines, None)
    assert (rank, expected) == (1, 2)  # 0, 1 and 2 hold 2 blocks; 1 and 2 are idle: 1 first


def test_an_overloaded_prefix_engine_is_passed_over_beyond_the_threshold() -> None:
    router = prefix_router(2, imbalance_threshold=4)
    engines = loads(0, 0)
    prompt = system(0)
    assert router.choose(req(prompt + user(0)), engines, None)[0] == 0
    engines[0].in_flight = 4  # a lead of 4: still within the threshold
    assert router.choose(req(prompt + user(1)), engines, None) == (0, 4)
    engines[0].in_flight = 5  # a lead of 5: the least-loaded engine instead
    assert router.choose(req(prompt + user(2)), engines, None) == (1, 0)
    assert router.stats.overloaded == 1
    # Engine 1 now caches the prompt too: the two share its users by load.
    assert router.choose(req(prompt + user(3)), engines, None) == (1, 4)


def test_pinning_wins_and_is_remembered() -> None:
    router = prefix_router(2)
    engines = loads(0, 0)
    prompt = system(3)
    assert router.choose(req(prompt + user(0)), engines, None)[0] == 0
    assert router.choose(req(prompt + user(1)), engines, engines[1]) == (1, 0)
    engines[0].in_flight = 1
    # Pinned there once, engine 1 holds the prompt as well, and it is idle.
    assert router.choose(req(prompt + user(2)), engines, None) == (1, 4)
    assert router.stats.pinned == 1


def test_the_last_prompt_token_is_never_expected_cached() -> None:
    router = prefix_router(1)
    engines = loads(0)
    prompt = system(0, blocks=2)  # exactly two blocks
    router.choose(req(prompt), engines, None)
    # The engine computes the last token, so only the first block can hit (vLLM and mock).
    assert router.choose(req(prompt), engines, None) == (0, 1)
    assert router.choose(req([*prompt, 7]), engines, None) == (0, 2)


def test_cache_salt_and_lora_adapter_key_the_cache() -> None:
    router = prefix_router(2)
    engines = loads(0, 0)
    prompt = system(0) + user(0)
    assert router.choose(req(prompt, cache_salt="alice"), engines, None)[0] == 0
    engines[0].in_flight = 1
    assert router.choose(req(prompt, cache_salt="bob"), engines, None) == (1, 0)
    lora = LoRARequest("adapter", 1, "/adapters/a")
    assert router.choose(req(prompt, lora_request=lora), engines, None)[1] == 0
    assert router.choose(req(prompt, cache_salt="alice"), engines, None) == (0, 5)


# ---------------------------------------------------------------------- memory


def test_memory_is_bounded_per_engine_least_recently_sent_first() -> None:
    router = prefix_router(1, memory_blocks=12)
    engines = loads(0)
    for n in range(5):  # 5 prompts x 4 blocks into 12 blocks: the oldest two are gone
        router.choose(req([*system(n), 1]), engines, None)
    assert router.remembered_blocks(0) == 12
    assert [router.choose(req([*system(n), 1]), loads(0), None)[1] for n in (4, 3, 2)] \
        == [4, 4, 4]
    # Prompts 0 and 1 were evicted (asking re-inserted them, evicting 3 and 4 in turn).
    assert router.choose(req([*system(0), 1]), engines, None)[1] == 0


def test_an_engine_with_fewer_gpu_blocks_is_remembered_with_fewer() -> None:
    router = PrefixRouter({0: BS, 1: BS}, {0: 8, 1: 100_000}, memory_blocks=100)
    assert (router.capacity(0), router.capacity(1)) == (8, 100)


# ---------------------------------------------------------------------- corrections


def test_fewer_cached_tokens_than_expected_shrink_the_memory() -> None:
    router = prefix_router(1, memory_blocks=64)
    engines = loads(0)
    for n in range(16):  # 64 blocks remembered
        router.choose(req([*system(n), 1]), engines, None)
    rank, ticket = router.choose(req([*system(15), 2]), engines, None)
    assert ticket == 4
    router.note_cached(rank, ticket, 4 * BS)  # as expected: confirmed
    assert router.capacity(0) == 64
    assert router.stats.corrections == 0
    rank, ticket = router.choose(req([*system(14), 2]), engines, None)
    router.note_cached(rank, ticket, 1 * BS)  # 3 blocks the engine no longer had
    assert router.capacity(0) == 61
    assert router.remembered_blocks(0) == 61
    assert router.stats.corrections == 1
    assert (router.stats.expected_cached_tokens, router.stats.reported_cached_tokens) \
        == (8 * BS, 5 * BS)
    # An engine that had more than expected lets the memory grow back (up to its cap).
    rank, ticket = router.choose(req([*system(20), 2]), engines, None)
    router.note_cached(rank, ticket, 40 * BS)
    assert router.capacity(0) == 64


def test_repeated_misses_never_shrink_below_the_floor_and_reset_forgets() -> None:
    router = prefix_router(1, memory_blocks=64)
    engines = loads(0)
    for _ in range(40):
        rank, ticket = router.choose(req([*system(0), 1]), engines, None)
        router.note_cached(rank, ticket, 0)
    assert router.capacity(0) == 16
    assert router.choose(req([*system(0), 1]), engines, None)[1] == 4
    router.engine_reset(0)
    assert router.remembered_blocks(0) == 0
    assert router.choose(req([*system(0), 1]), engines, None)[1] == 0


# ---------------------------------------------------------------------- config


def test_make_router_and_config_refuse_bad_knobs_naming_them() -> None:
    assert isinstance(make_router("load", {0: BS}, {0: 10}), LoadRouter)
    assert isinstance(make_router("prefix", {0: BS}, {0: 10}), PrefixRouter)
    with pytest.raises(ValueError, match="routing must be one of 'load', 'prefix'"):
        make_router("cache", {0: BS}, {0: 10})
    with pytest.raises(ValueError, match="mode must be one of 'load', 'prefix', got 'round-r"):
        RoutingConfig("round-robin")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_imbalance_threshold must be a number >= 0"):
        RoutingConfig(prefix_imbalance_threshold=-1)
    with pytest.raises(ValueError, match="prefix_memory_blocks must be an integer >= 1"):
        RoutingConfig(prefix_memory_blocks=0)
    with pytest.raises(ValueError, match="routing must be a RoutingConfig, got str"):
        EngineCoreClientConfig(routing="prefix")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="imbalance_threshold"):
        prefix_router(imbalance_threshold=float("nan"))


# ---------------------------------------------------------------------- invariants

_tokens = st.lists(st.integers(0, 3), max_size=80)


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(a=_tokens, b=_tokens, size=st.sampled_from([1, 2, 4, 16]))
def test_hash_chains_agree_exactly_on_the_shared_whole_blocks(a: list[int], b: list[int],
                                                               size: int) -> None:
    ha, hb = block_hashes(a, size, 7), block_hashes(b, size, 7)
    assert len(ha) == len(a) // size
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    common = 0
    while common < min(len(ha), len(hb)) and ha[common] == hb[common]:
        common += 1
    assert common == min(shared // size, len(ha), len(hb))
    assert block_hashes(a, size, 8)[:1] != ha[:1] or not ha  # the seed keys every chain


@settings(derandomize=True, database=None, deadline=None, max_examples=100)
@given(prompts=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), max_size=60),
       cap=st.integers(1, 24))
def test_the_memory_is_an_lru_of_at_most_its_cap(prompts: list[tuple[int, int]],
                                                 cap: int) -> None:
    router = prefix_router(1, memory_blocks=cap)
    engines = loads(0)
    model: list[int] = []  # a reference LRU of block hashes
    for sys_id, extra in prompts:
        prompt = system(sys_id, blocks=2) + list(range(extra))
        hashes = block_hashes(prompt, BS, hash(("anyio-genout prefix", None, None)))
        usable = hashes[:(len(prompt) - 1) // BS]
        lead = 0
        while lead < len(usable) and usable[lead] in model:
            lead += 1
        assert router.choose(req(prompt), engines, None)[1] == lead
        for h in hashes:
            if h in model:
                model.remove(h)
            model.append(h)
        del model[:-cap]
        assert router.remembered_blocks(0) == len(model) <= cap
