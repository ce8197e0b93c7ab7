"""Which engine a new request goes to: load-only or prefix-aware routing (sans I/O).

Nothing here waits or imports anyio or zmq: the registry (:mod:`.registry`) calls a
:class:`Router` synchronously when a request is opened, hands it the engines that may take
the request (the live ones, in tie order), and reports back what the engines say about
their prefix caches. docs/routing.md describes both routers, their knobs and when to use
which.

* :class:`LoadRouter`: vLLM's load score (the larger of the requests this client has in
  flight on an engine and the running + waiting count of its latest scheduler stats), plus
  vLLM's KV-usage penalty on waiting requests (``DPLBAsyncMPClient``): the least loaded
  engine wins, ties go to the first in tie order.
* :class:`PrefixRouter`: remembers, per engine, the hash chains of the prompt blocks it sent
  there (an LRU of block hashes, bounded), and sends a request where the longest prefix of
  its prompt is expected to be cached, unless that engine's load exceeds the least-loaded
  engine's by more than ``imbalance_threshold``; the cached-token counts the engines report
  in the first output correct its memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, Protocol

import attrs

from ..protocol import EngineCoreRequest

__all__ = [
    "DEFAULT_IMBALANCE_THRESHOLD", "DEFAULT_MEMORY_BLOCKS", "ROUTING_MODES", "EngineLoad",
    "LoadRouter", "PrefixRouter", "Router", "RoutingStats", "block_hashes", "make_router",
]

#: The routing modes :func:`make_router` knows.
ROUTING_MODES: Final = ("load", "prefix")
RoutingMode = Literal["load", "prefix"]

#: :class:`PrefixRouter`: load-score lead over the least-loaded engine up to which the engine
#: with the longest cached prefix still gets the request (see docs/routing.md for the choice).
DEFAULT_IMBALANCE_THRESHOLD: Final = 8.0
#: :class:`PrefixRouter`: block hashes remembered per engine at most (about 100 bytes each;
#: an engine reporting fewer ``num_gpu_blocks`` gets that many).
DEFAULT_MEMORY_BLOCKS: Final = 32768
#: Engine capacity the corrections never shrink the memory below (in blocks).
_MIN_CAPACITY: Final = 16
#: vLLM's KV-usage penalty: waiting requests weigh ``_KV_PENALTY * (usage - 0.5)`` more above
#: half usage (0 at <= 50 %, 3x at 100 %), as in ``DPLBAsyncMPClient``.
_KV_PENALTY: Final = 6.0


class EngineLoad:
    """Routing state of one engine: requests in flight and its latest scheduler stats."""

    __slots__ = ("in_flight", "kv_cache_usage", "rank", "running", "waiting")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.in_flight = 0
        self.running: int | None = None
        self.waiting: int | None = None
        self.kv_cache_usage = 0.0

    @property
    def score(self) -> float:
        """vLLM's load score: max(in flight, running + waiting), plus ``waiting * 6 *
        (kv_cache_usage - 0.5)`` when the KV cache is more than half used."""
        if self.running is None or self.waiting is None:
            return self.in_flight
        score: float = max(self.in_flight, self.running + self.waiting)
        if self.waiting and self.kv_cache_usage > 0.5:
            score += self.waiting * _KV_PENALTY * (self.kv_cache_usage - 0.5)
        return score


def _least_loaded(candidates: Sequence[EngineLoad]) -> EngineLoad:
    best = candidates[0]
    best_score = best.score
    for load in candidates[1:]:
        score = load.score
        if score < best_score:
            best, best_score = load, score
    return best


@attrs.define
class RoutingStats:
    """What a router decided so far (counters; for tests, benchmarks and tuning).

    ``by_prefix``: requests sent to the engine with the longest expected cached prefix;
    ``by_load``: requests sent to the least-loaded engine (no engine had a prefix, or load
    only); ``overloaded``: of those, requests whose best-prefix engine was passed over for
    load; ``pinned``: requests with a ``data_parallel_rank``; ``expected_cached_tokens`` /
    ``reported_cached_tokens``: summed over requests whose first output reported prefill
    stats; ``corrections``: reports that differed from the expectation.
    """

    by_prefix: int = 0
    by_load: int = 0
    overloaded: int = 0
    pinned: int = 0
    expected_cached_tokens: int = 0
    reported_cached_tokens: int = 0
    corrections: int = 0


class Router(Protocol):
    """Chooses an engine for each new request (synchronously, on the event loop).

    ``learns``: whether the router wants :meth:`note_cached` and :meth:`engine_reset` calls
    (the reader skips looking for prefill stats otherwise).
    """

    learns: bool
    stats: RoutingStats

    def choose(self, request: EngineCoreRequest, candidates: Sequence[EngineLoad],
               pinned: EngineLoad | None) -> tuple[int, Any]:
        """The rank for ``request`` among ``candidates`` (non-empty; in tie order), or
        ``pinned`` when the request names its engine; and a ticket (None, or what
        :meth:`note_cached` is given back for this request)."""
        ...

    def note_cached(self, rank: int, ticket: Any, num_cached_tokens: int) -> None:
        """The engine ``rank`` reported ``num_cached_tokens`` for the request of ``ticket``."""
        ...

    def engine_reset(self, rank: int) -> None:
        """Engine ``rank``'s prefix cache is empty now (reset, restarted, or gone)."""
        ...


class LoadRouter:
    """The least-loaded engine by :attr:`EngineLoad.score` (vLLM's rule, KV penalty
    included); ties go to the first candidate."""

    learns = False

    def __init__(self) -> None:
        self.stats = RoutingStats()

    def choose(self, request: EngineCoreRequest, candidates: Sequence[EngineLoad],
               pinned: EngineLoad | None) -> tuple[int, Any]:
        if pinned is not None:
            self.stats.pinned += 1
            return pinned.rank, None
        self.stats.by_load += 1
        return _least_loaded(candidates).rank, None

    def note_cached(self, rank: int, ticket: Any, num_cached_tokens: int) -> None:
        return

    def engine_reset(self, rank: int) -> None:
        return


def block_hashes(prompt: Sequence[int], block_size: int, seed: int) -> list[int]:
    """The hash chain of ``prompt``'s full blocks: block i's hash covers blocks 0..i and
    ``seed`` (what else keys the engine's cache: the cache salt, the LoRA adapter).

    Process-local values (Python's ``hash``), as the engine's own are its own: they are only
    ever compared with each other."""
    tokens = prompt if isinstance(prompt, tuple) else tuple(prompt)
    h = seed
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tokens[start:start + block_size]))
        out.append(h)
    return out


def _seed(request: EngineCoreRequest) -> int:
    lora = request.lora_request
    return hash(("anyio-genout prefix", request.cache_salt,
                 None if lora is None else lora.lora_int_id))


class _Memory:
    """One engine's remembered block hashes, least recently sent first."""

    __slots__ = ("block_size", "blocks", "capacity", "limit")

    def __init__(self, block_size: int, limit: int) -> None:
        self.block_size = block_size
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.limit = limit  # the cap: never more than this many blocks
        self.capacity = limit  # the current estimate of what the engine keeps

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are remembered."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        blocks = self.blocks
        move = blocks.move_to_end
        for h in hashes:
            if h in blocks:
                move(h)
            else:
                blocks[h] = None
        self.trim()

    def trim(self) -> None:
        blocks = self.blocks
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class PrefixRouter:
    """Prefix-aware routing with a load guard (see the module docstring and docs/routing.md).

    ``block_sizes``: each engine's KV-cache block size (its ready response's);
    ``num_gpu_blocks``: each engine's KV-cache size in blocks (the memory of an engine holds
    at most ``min(memory_blocks, num_gpu_blocks)`` hashes); ``imbalance_threshold``: the
    load-score lead over the least-loaded candidate up to which the best-prefix engine still
    gets the request; ``memory_blocks``: block hashes remembered per engine at most.

    A request goes to the candidate with the most leading prompt blocks remembered for it
    (ties: the lower score, then tie order). With none remembered anywhere, or when that
    engine's score exceeds the least-loaded candidate's by more than
    ``imbalance_threshold``, it goes to the least-loaded one (:class:`LoadRouter`'s rule).
    Either way every full block of its prompt is remembered for the engine chosen (it will
    cache them), as most recent.

    Corrections: an engine that reports fewer cached tokens than expected evicted blocks
    the memory still held, so that engine's capacity estimate shrinks by the blocks missed
    (its oldest hashes are forgotten, never below 16 blocks); one that reports more kept
    more than the memory did, so its capacity grows again by the surplus (up to its cap).
    :meth:`engine_reset` forgets an engine's blocks.
    """

    learns = True

    def __init__(self, block_sizes: Mapping[int, int], num_gpu_blocks: Mapping[int, int], *,
                 imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD,
                 memory_blocks: int = DEFAULT_MEMORY_BLOCKS) -> None:
        if not imbalance_threshold >= 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold!r}")
        if memory_blocks < 1:
            raise ValueError(f"memory_blocks must be at least 1, got {memory_blocks!r}")
        self.imbalance_threshold = imbalance_threshold
        self.memory_blocks = memory_blocks
        self.stats = RoutingStats()
        self._memory = {
            rank: _Memory(size, max(1, min(memory_blocks, num_gpu_blocks.get(rank, memory_blocks))))
            for rank, size in block_sizes.items()
        }

    def remembered_blocks(self, rank: int) -> int:
        """Block hashes remembered for engine ``rank`` now."""
        return len(self._memory[rank].blocks)

    def capacity(self, rank: int) -> int:
        """The current estimate of engine ``rank``'s prefix cache, in blocks."""
        return self._memory[rank].capacity

    def choose(self, request: EngineCoreRequest, candidates: Sequence[EngineLoad],
               pinned: EngineLoad | None) -> tuple[int, Any]:
        prompt = request.prompt_token_ids
        seed = _seed(request)
        chains: dict[int, list[int]] = {}
        memory = self._memory
        stats = self.stats

        def chain(block_size: int) -> list[int]:
            hashes = chains.get(block_size)
            if hashes is None:
                hashes = chains[block_size] = block_hashes(prompt, block_size, seed)
            return hashes

        def expected(mem: _Memory) -> int:
            # The engine always computes the last prompt token: whole blocks before it hit.
            usable = (len(prompt) - 1) // mem.block_size
            return mem.matched(chain(mem.block_size)[:usable])

        if pinned is not None:
            stats.pinned += 1
            chosen = pinned
            match = expected(memory[chosen.rank])
        else:
            least = _least_loaded(candidates)
            chosen, match, best_score = least, 0, least.score
            for load in candidates:
                m = expected(memory[load.rank])
                if m > match or (m == match and m and load.score < best_score):
                    chosen, match, best_score = load, m, load.score
            if match and best_score - least.score > self.imbalance_threshold:
                stats.overloaded += 1
                chosen, match = least, expected(memory[least.rank])
            if chosen is least and not match:
                stats.by_load += 1
            else:
                stats.by_prefix += 1
        mem = memory[chosen.rank]
        mem.insert(chain(mem.block_size))
        return chosen.rank, match

    def note_cached(self, rank: int, ticket: Any, num_cached_tokens: int) -> None:
        mem = self._memory.get(rank)
        if mem is None or type(ticket) is not int:
            return
        stats = self.stats
        bs = mem.block_size
        stats.expected_cached_tokens += ticket * bs
        stats.reported_cached_tokens += num_cached_tokens
        got = num_cached_tokens // bs
        if got == ticket:
            return
        stats.corrections += 1
        if got < ticket:
            # The engine evicted blocks this memory still held: it keeps less than thought.
            mem.capacity = max(min(_MIN_CAPACITY, mem.limit), mem.capacity - (ticket - got))
            mem.trim()
        else:
            # It kept more than remembered (other front ends' requests, or a capacity
            # estimate shrunk too far): let the memory grow again.
            mem.capacity = min(mem.limit, mem.capacity + (got - ticket))

    def engine_reset(self, rank: int) -> None:
        mem = self._memory.get(rank)
        if mem is not None:
            mem.blocks.clear()


def make_router(mode: str, block_sizes: Mapping[int, int], num_gpu_blocks: Mapping[int, int],
                *, imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD,
                memory_blocks: int = DEFAULT_MEMORY_BLOCKS) -> Router:
    """The router of ``mode`` (one of :data:`ROUTING_MODES`) for engines with these block
    sizes and KV-cache sizes (by rank). Raises :class:`ValueError` naming a bad mode or
    knob."""
    if mode == "load":
        return LoadRouter()
    if mode == "prefix":
        return PrefixRouter(block_sizes, num_gpu_blocks, imbalance_threshold=imbalance_threshold,
                            memory_blocks=memory_blocks)
    raise ValueError(f"routing must be one of {', '.join(map(repr, ROUTING_MODES))}, "
                     f"got {mode!r}")
