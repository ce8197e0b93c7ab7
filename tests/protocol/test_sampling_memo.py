"""What is worked out for a shared SamplingParams (a successful validation, its wire map,
its EOS copy) is remembered, outside the instance: it holds nothing but its fields."""

from __future__ import annotations

import attrs
import pytest

from anyio_genout import InvalidRequestError
from anyio_genout.protocol import SamplingParams
from anyio_genout.protocol.sampling import MEMO_SIZE, fill_eos


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
    object.__setattr__(copy, "top_k", -5)  # behind its back: a check that ran would refuse
    second.to_engine_request("b-1", eos_token_id=7).sampling_params.validate(vocab_size=10)
    object.__setattr__(copy, "top_k", 0)
    other = params.with_eos_token_id(2**40)
    assert other.eos_token_id == 2**40 and other is not copy
    assert params.with_eos_token_id(int(str(2**40))) is other  # an equal int, not the same


def test_the_params_hold_nothing_but_their_fields() -> None:
    """No hidden state: every attribute is a constructor field, and validating, encoding and
    filling EOS change none of them (nor equality, nor the repr)."""
    assert all(field.init for field in attrs.fields(SamplingParams))
    params = SamplingParams(temperature=0.5, max_tokens=8, stop_token_ids=[3])
    before = (attrs.asdict(params, recurse=False), repr(params))
    params.validate(vocab_size=10)
    params.wire_for_request(5)
    fill_eos(params, 7, (8,))
    params.with_eos_token_id(9)
    assert (attrs.asdict(params, recurse=False), repr(params)) == before
    assert params == SamplingParams(temperature=0.5, max_tokens=8, stop_token_ids=[3])


def test_the_memos_forget_the_oldest_instances() -> None:
    """Many distinct instances: each is still checked (a remembered one is the same object)."""
    many = [SamplingParams(top_k=k) for k in range(MEMO_SIZE * 3)]
    for params in many:
        params.validate(vocab_size=10)
    object.__setattr__(many[0], "stop_token_ids", (5000,))  # long forgotten: checked again
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids\[0\]"):
        many[0].validate(vocab_size=10)


@pytest.mark.parametrize(("own", "ignore_eos", "expected_eos", "expected_stops"), [
    (None, False, 7, (3, 9, 8)),  # the model's EOS filled in, its other EOS ids stop
    (5, False, 5, (3, 9, 8)),  # the request's own EOS wins
    (None, True, 7, (3, 9)),  # ignore_eos: EOS held back by min_tokens only, no extra stops
])
def test_the_one_eos_fill_and_its_precedence(own: int | None, ignore_eos: bool,
                                             expected_eos: int, expected_stops: tuple[int, ...]
                                             ) -> None:
    params = SamplingParams(eos_token_id=own, ignore_eos=ignore_eos, stop_token_ids=[3, 9])
    others = (8, 9)
    filled = fill_eos(params, 7, others)
    assert (filled.eos_token_id, filled.stop_token_ids) == (expected_eos, expected_stops)
    assert fill_eos(params, 7, others) is filled  # one copy for a shared instance
    assert params.eos_token_id == own and params.stop_token_ids == (3, 9)  # unchanged
