"""SamplingParams remembers a successful validation and its wire map (it is frozen)."""

from __future__ import annotations

import pytest

from anyio_genout import InvalidRequestError
from anyio_genout.protocol import SamplingParams


def test_validation_is_remembered_per_limits() -> None:
    params = SamplingParams(temperature=0.5, stop_token_ids=[900])
    params.validate(vocab_size=1000)
    # Behind the frozen instance's back: a check that ran again would now refuse it.
    object.__setattr__(params, "stop_token_ids", (5000,))
    params.validate(vocab_size=1000)  # remembered: no error, because no work
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids\[0\]"):
        params.validate(vocab_size=800)  # other limits are checked again


def test_mutable_mappings_are_checked_every_time() -> None:
    bias = {5: 1.0}
    params = SamplingParams(logit_bias=bias)
    params.validate(vocab_size=10)
    bias[50] = 1.0  # the caller changed the mapping after the first check
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        params.validate(vocab_size=10)
    assert params.wire_for_request(4) is not params.wire_for_request(4)


def test_wire_map_is_shared_per_max_tokens_and_equal_to_to_wire() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=9)
    first = params.wire_for_request(7)
    assert params.wire_for_request(7) is first
    assert first == params.to_wire(max_tokens=7)
    assert params.wire_for_request(8) == params.to_wire(max_tokens=8)
    assert params == SamplingParams(temperature=0.0, max_tokens=9)  # memo not in equality


def test_the_eos_copy_is_made_once_per_value_and_keeps_its_memos() -> None:
    """The client fills its configured EOS into shared parameters: one copy per value, so
    that copy's validation and wire memos serve every request."""
    from anyio_genout import GenerateRequest

    params = SamplingParams(temperature=0.5, max_tokens=8)
    first = GenerateRequest(request_id="a", prompt_token_ids=[1], sampling_params=params)
    second = GenerateRequest(request_id="b", prompt_token_ids=[2], sampling_params=params)
    copy = first.to_engine_request("a-1", eos_token_id=7).sampling_params
    assert second.to_engine_request("b-1", eos_token_id=7).sampling_params is copy
    assert copy == SamplingParams(temperature=0.5, max_tokens=8, eos_token_id=7)
    assert params.eos_token_id is None  # the shared instance is unchanged
    copy.validate(vocab_size=10)
    assert copy._validated_for == (10, None)
    assert params.with_eos_token_id(7) is copy
    other = params.with_eos_token_id(2**40)
    assert other.eos_token_id == 2**40 and other is not copy
    assert params.with_eos_token_id(int(str(2**40))) is other  # an equal int, not the same
