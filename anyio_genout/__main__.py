"""``python -m anyio_genout``: the ``anyio-genout`` command line."""

import sys

from .cli.main import main

sys.exit(main())
