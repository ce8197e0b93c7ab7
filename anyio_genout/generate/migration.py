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

import os
from collections.abc import Sequence

import attrs

from ..protocol import EngineCoreRequest

__all__ = ["can_migrate", "continuation_request", "migrated_request_id"]


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
