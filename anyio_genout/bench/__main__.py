"""``python -m anyio_genout.bench``: the same as ``anyio-genout bench``."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main(prog="python -m anyio_genout.bench"))
