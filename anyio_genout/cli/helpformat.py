"""``--help`` that shows every option's default."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.HelpFormatter):
    """Ends every option's help with its default.

    Unlike :class:`argparse.ArgumentDefaultsHelpFormatter` it leaves alone a help text that
    already says its default in its own words (``"(default: all three)"``), shows a flag's
    default as on/off, and adds nothing for a ``None`` default, whose meaning only the help
    text can say.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or "default" in text or action.default is None):
            return text
        if action.nargs == 0:  # store_true / store_false / store_const
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"
