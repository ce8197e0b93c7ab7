"""Request migration: the engine request that continues a request whose engine died.

With ``ClientConfig(migration_limit=N)``, a :class:`~anyio_genout.GenerateStream` whose
engine dies (an :class:`~anyio_genout.EngineDeadError` naming it, while the client stays
healthy: ``engine_failure="engine"``) resubmits the request to a live engine as a
*continuation*: the original prompt plus every token already delivered, ``max_tokens`` and
``min_tokens`` reduced by their count, everything else as sent (the same sampling parameters,
seed, arrival time, priority, LoRA, cache salt, external id). The stream carries on with the
new engine's outputs; the consumer sees neither the death nor the move (docs/reliability.md,
"Request migration").

Not migrated (the error surfaces as without migration): a request pinned to an engine
(``data_parallel_rank``), one with structured outputs (the grammar would restart from its
beginning on the continuation), and one that has used up its ``migration_limit``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from ..engine import EngineCoreClient, EngineCoreOutputStream
from ..errors import EngineDeadError, GenoutError
from ..protocol import EngineCoreRequest

if TYPE_CHECKING:
    from ..metrics import Metrics, RequestTracker

__all__ = ["Migration", "can_migrate", "continuation_request", "migrated_request_id"]

logger = logging.getLogger("anyio_genout.generate")


def can_migrate(request: EngineCoreRequest) -> bool:
    """Whether ``request`` (as sent) may be continued on another engine at all."""
    return (request.data_parallel_rank is None
            and request.sampling_params.structured_outputs is None)


def migrated_request_id(first_id: str, number: int) -> str:
    """The engine request id of a request's ``number``-th continuation:
    ``"{first_id}-m{number}-{8 hex}"``, where ``first_id`` is the id the first engine knew
    it by. The random part keeps it apart from every id a caller may choose (also with
    ``randomize_request_ids=False``) and from an earlier request's continuation."""
    return f"{first_id}-m{number}-{os.urandom(4).hex()}"


def continuation_request(first: EngineCoreRequest, max_tokens: int, delivered: Sequence[int],
                         request_id: str, *, keep_prompt_logprobs: bool) -> EngineCoreRequest:
    """The request that continues ``first`` (as sent, with its resolved ``max_tokens``)
    after ``delivered`` tokens, under ``request_id``.

    ``prompt_logprobs`` is dropped unless ``keep_prompt_logprobs`` (the consumer already has
    the original prompt's; the continuation's prompt is longer). Raises ValueError if
    nothing is left to generate (``delivered`` reaches ``max_tokens``: the request had
    ended).
    """
    remaining = max_tokens - len(delivered)
    if remaining < 1:
        raise ValueError(f"request {first.request_id!r}: {len(delivered)} tokens delivered "
                         f"of max_tokens={max_tokens}: nothing to continue")
    params = first.sampling_params
    changes: dict[str, object] = {}
    if params.min_tokens:
        changes["min_tokens"] = max(0, params.min_tokens - len(delivered))
    if params.max_tokens is not None:
        changes["max_tokens"] = remaining
    if params.prompt_logprobs is not None and not keep_prompt_logprobs:
        changes["prompt_logprobs"] = None
    if changes:
        params = attrs.evolve(params, **changes)  # type: ignore[arg-type]
    return attrs.evolve(first, request_id=request_id,
                        prompt_token_ids=(*first.prompt_token_ids, *delivered),
                        sampling_params=params, max_tokens=remaining)


@attrs.define(eq=False)
class Migration:
    """A stream's migration: the tokens delivered so far, the moves made, and the rule that
    guards the next one (a collaborator of :class:`~anyio_genout.GenerateStream`, made when
    a stream that may migrate is entered).

    ``first`` is the request as the first engine got it, ``max_tokens`` the cap it applied,
    ``limit`` the most moves allowed. ``continued``: the engine request running now continues
    one whose prompt info was delivered (so its prefill stats are not the prompt's).
    """

    engine: EngineCoreClient
    metrics: Metrics
    tracker: RequestTracker
    first: EngineCoreRequest
    max_tokens: int
    limit: int
    delivered: list[int] = attrs.field(factory=list)
    moves: int = 0
    continued: bool = False

    def may_move(self, raw: EngineCoreOutputStream, error: EngineDeadError) -> bool:
        """Whether ``error`` (just raised by ``raw``) is its engine's death and the request
        may move to another engine (moves left, the client healthy)."""
        ranks = error.ranks
        return (self.moves < self.limit and ranks is not None and raw.engine_index in ranks
                and self.engine.is_healthy)

    def move(self, raw: EngineCoreOutputStream, error: EngineDeadError, *,
             prompt_pending: bool) -> EngineCoreOutputStream:
        """Resubmit the request as a continuation on a live engine and return its stream
        (synchronous: the new engine request is queued). ``prompt_pending``: the prompt info
        was not delivered yet (the continuation keeps ``prompt_logprobs`` then).

        Raises:
            EngineDeadError: ``error`` itself, when no engine can take the continuation (the
                client became unhealthy, nothing is left to generate, the id was refused).
        """
        delivered = self.delivered
        number = self.moves + 1
        first = self.first
        new: EngineCoreOutputStream | None = None
        try:
            request = continuation_request(
                first, self.max_tokens, delivered, migrated_request_id(first.request_id, number),
                keep_prompt_logprobs=prompt_pending)
            new = self.engine.open_stream(request)
        except (GenoutError, ValueError) as exc:
            logger.info("request %s: engine %d died and the request cannot move to another "
                        "engine: %s", first.request_id, raw.engine_index, exc)
        if new is None:
            raise error  # outside the handler: the caller's own error, its context unchanged
        raw.close()  # ended already (its error was read): nothing is aborted
        self.moves = number
        self.continued = not prompt_pending
        self.metrics.record_migration(self.tracker, raw.engine_index, new.engine_index)
        logger.info("request %s: engine %d died after %d token(s); continuing on engine %d "
                    "as %s (migration %d of at most %d)", first.request_id, raw.engine_index,
                    len(delivered), new.engine_index, new.request_id, number, self.limit)
        return new
