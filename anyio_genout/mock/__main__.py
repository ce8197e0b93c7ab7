"""``python -m anyio_genout.mock``: run a mock engine core until SIGINT/SIGTERM."""

import sys

from .cli import main

sys.exit(main(prog="python -m anyio_genout.mock"))
