"""The ``anyio-genout`` command line: ``generate``, ``run``, ``mock-engine``, ``bench``."""
