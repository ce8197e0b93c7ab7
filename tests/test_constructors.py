"""Streams are made by their factories only (trio's rule): a direct construction is a
clear TypeError that says what to call instead."""

from __future__ import annotations

from typing import Any

import pytest

from anyio_genout import EngineCoreOutputStream, GenerateStream, TextStream


@pytest.mark.parametrize(("cls", "args", "kwargs", "hint"), [
    (GenerateStream, 4, {"callers_ids": False}, "client.generate(request)"),
    (EngineCoreOutputStream, 6, {}, "EngineCoreClient.call()"),
    (TextStream, 4, {}, "text_client.generate(request)"),
])
def test_a_stream_has_no_public_constructor(cls: Any, args: int, kwargs: dict[str, Any],
                                            hint: str) -> None:
    with pytest.raises(TypeError, match="no public constructor") as exc:
        cls(*([None] * args), **kwargs)
    assert hint in str(exc.value)
