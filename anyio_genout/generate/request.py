"""``GenerateRequest``: what a user asks for, and how it becomes an engine request."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence

import attrs

from ..errors import InvalidRequestError
from ..protocol import EngineCoreRequest, LoRARequest, SamplingParams
from ..protocol.sampling import fill_eos, token_ids

__all__ = ["GenerateRequest", "internal_request_id"]


def _token_ids(value: Iterable[int]) -> tuple[int, ...]:
    return token_ids(value, "prompt_token_ids")


@attrs.frozen(kw_only=True)
class GenerateRequest:
    """One generation request (token ids in, token ids out).

    ``request_id`` is yours (the *external* id); the client sends the engine an internal id
    ``"{request_id}-{8 hex}"`` unless created with ``randomize_request_ids=False``, so two live
    requests may share an external id. ``arrival_time`` (wall clock, seconds since the epoch)
    defaults to now; time to first token and end-to-end latency are measured from it.
    ``prompt_token_ids`` may be a list or tuple of ints or a 1-d numpy integer array.

    Construction only converts the prompt (a value that is no sequence at all raises
    :class:`~anyio_genout.InvalidRequestError`); everything else is checked when
    ``async with client.generate(request)`` is entered, before anything is sent, by the one
    request validation (:meth:`EngineCoreRequest.validate`), which names the field.
    """

    request_id: str
    prompt_token_ids: Sequence[int] = attrs.field(converter=_token_ids)
    sampling_params: SamplingParams = attrs.field(factory=SamplingParams)
    arrival_time: float | None = None
    cache_salt: str | None = None
    trace_headers: Mapping[str, str] | None = None
    priority: int = 0
    data_parallel_rank: int | None = None
    lora_request: LoRARequest | None = None

    def to_engine_request(self, internal_id: str, *, eos_token_id: int | None = None
                          ) -> EngineCoreRequest:
        """The engine request, not validated (:meth:`EngineCoreRequest.validate` does that).

        Raises :class:`~anyio_genout.InvalidRequestError` only if ``sampling_params`` is not
        a :class:`SamplingParams`, which the generate layer needs to build the request.
        """
        params = self.sampling_params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"must be a SamplingParams, got "
                                      f"{type(params).__name__}")
        if eos_token_id is not None:
            params = fill_eos(params, eos_token_id)  # the one EOS fill, its one precedence
        return EngineCoreRequest(
            request_id=internal_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=params,
            arrival_time=time.time() if self.arrival_time is None else self.arrival_time,
            lora_request=self.lora_request,
            cache_salt=self.cache_salt,
            data_parallel_rank=self.data_parallel_rank,
            priority=self.priority,
            trace_headers=self.trace_headers,
            external_req_id=self.request_id,
        )


def internal_request_id(external_id: str, randomize: bool) -> str:
    """``"{external_id}-{8 hex}"``, or ``external_id`` itself if not ``randomize``.

    An id that is not a non-empty string is returned as it is, for validation to refuse it
    as ``request_id``.
    """
    if not randomize or type(external_id) is not str or not external_id:
        return external_id
    # 8 random hex characters, as uuid4().hex[:8] would give, for a fifth of the cost.
    return f"{external_id}-{os.urandom(4).hex()}"
