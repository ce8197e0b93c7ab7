"""Tests of the sans-IO wire protocol (anyio_genout.protocol)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis.configuration import set_hypothesis_home_dir

# Hypothesis keeps caches in <home>/.hypothesis, by default in the working directory; the
# project's norecursedirs replaces pytest's defaults, so a .hypothesis directory at the root
# would be visited (with a warning, an error under filterwarnings=error). Keep it elsewhere.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "anyio-genout-hypothesis")
