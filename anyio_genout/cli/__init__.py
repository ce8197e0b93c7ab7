"""The ``anyio-genout`` command line: ``generate``, ``run``, ``serve``, ``mock-engine``,
``bench``; every command line of the package lives here."""
