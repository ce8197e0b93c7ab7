"""Streams are made by their factories only (trio's rule): a direct construction is a
clear TypeError that says what to call instead."""

from __future__ import annotations

from typing import Any

import pytest

from anyio_genout import EngineCoreOutputStream, GenerateStream


@pytest.mark.parametrize(("cls", "hint"), [
    (GenerateStream, "client.generate(request)"),
    (EngineCoreOutputStream, "EngineCoreClient.call()"),
])
def test_a_stream_has_no_public_constructor(cls: Any, hint: str) -> None:
    with pytest.raises(TypeError, match="no public constructor") as exc:
        cls(*([None] * 4), callers_ids=False) if cls is GenerateStream else cls(*([None] * 5))
    assert hint in str(exc.value)
