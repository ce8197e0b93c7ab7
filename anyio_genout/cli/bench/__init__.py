"""``anyio-genout bench``'s command line: the parser (:mod:`.main`), one module per command.

Only argument parsing, checks of what is installed, and printing live here; the measuring
is the library :mod:`anyio_genout.bench`, which imports nothing from :mod:`anyio_genout.cli`.
"""
