"""anyio-genout: a structured-concurrency client for vLLM engine cores."""
from .errors import *  # noqa: F403
from .errors import __all__ as _errors_all

__all__ = [*_errors_all]
