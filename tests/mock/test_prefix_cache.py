"""The mock engine's prefix cache: bounded by ``prefix_cache_blocks`` (least recently used
evicted), reported in the first output's prefill stats as vLLM reports it, and, opt-in, a
prefill cost per prompt token not found cached (so cache hits shorten time to first
token)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anyio_genout.cli.mock_cmd import build_parser, config_from_args
from anyio_genout.mock import MockEngineConfig
from anyio_genout.mock.prefix_cache import PrefixCache
from tests.mock.frontend import running_engine

BS = 16

pytestmark = pytest.mark.anyio


def greedy(max_tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": max_tokens}


def prompt(n: int, blocks: int = 4) -> list[int]:
    """Prompt ``n``: ``blocks`` whole blocks of its own tokens, and one more token."""
    return [1000 * (n + 1) + i for i in range(blocks * BS + 1)]


async def test_a_small_cache_evicts_the_least_recently_used_prompts() -> None:
    async with running_engine(prefix_cache_blocks=8) as (_, front):
        for n in (0, 1, 2):  # 3 prompts x 4 blocks into 8: prompt 0 is evicted
            await front.add(f"warm{n}", prompt(n), greedy(1))
            await front.collect(f"warm{n}")
        for rid, n in (("again2", 2), ("again1", 1), ("again0", 0)):
            await front.add(rid, prompt(n), greedy(1))
        got = await front.collect("again2", "again1", "again0")
    cached = {rid: outs[0].prefill_stats.num_cached_tokens  # type: ignore[union-attr]
              for rid, outs in got.items()}
    assert cached == {"again2": 4 * BS, "again1": 4 * BS, "again0": 0}


async def test_prefill_cost_makes_cache_hits_reach_their_first_token_sooner() -> None:
    # 10 ms per computed prompt token: a 65-token prompt costs 650 ms uncached, 10 ms cached
    # (its last token); the margin absorbs a loaded machine's delays on the warm request.
    async with running_engine(step_time=0.002, prefill_time_per_token=0.01) as (_, front):
        await front.add("cold", prompt(0), greedy(2))
        start = time.monotonic()
        await front.collect("cold")
        cold = time.monotonic() - start
        await front.add("warm", prompt(0), greedy(2))
        start = time.monotonic()
        got = await front.collect("warm")
        warm = time.monotonic() - start
    assert got["warm"][0].prefill_stats.num_cached_tokens == 4 * BS  # type: ignore[union-attr]
    assert cold >= 0.6
    assert warm < cold / 2


def test_the_cli_takes_the_cache_size_and_the_prefill_cost() -> None:
    args = build_parser().parse_args(["--handshake-address", "tcp://127.0.0.1:5555",
                                      "--prefix-cache-blocks", "64",
                                      "--prefill-time-per-token", "0.0001"])
    config = config_from_args(args)
    assert (config.prefix_cache_size, config.prefill_time_per_token) == (64, 0.0001)
    default = MockEngineConfig(handshake_address="tcp://127.0.0.1:5555")
    assert default.prefix_cache_size == default.gpu_blocks  # unchanged unless asked
    assert default.prefill_time_per_token == 0.0


@settings(derandomize=True, database=None, deadline=None, max_examples=100)
@given(requests=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3 * BS)), max_size=40),
       capacity=st.integers(1, 12))
def test_the_cache_is_an_lru_of_whole_blocks(requests: list[tuple[int, int]],
                                             capacity: int) -> None:
    cache = PrefixCache(BS, capacity)
    model: list[tuple[int, ...]] = []  # the reference LRU: each block's whole prefix
    for n, extra in requests:
        tokens = prompt(n, blocks=1)[:BS] + list(range(extra))
        prefixes = [tuple(tokens[:(i + 1) * BS]) for i in range(len(tokens) // BS)]
        hits = 0
        for p in prefixes[:(len(tokens) - 1) // BS]:
            if p not in model:
                break
            hits += 1
        assert cache.lookup_and_insert(tokens, None) == hits * BS
        for p in prefixes:
            if p in model:
                model.remove(p)
            model.append(p)
        del model[:-capacity]
        assert len(cache) == len(model) <= capacity
