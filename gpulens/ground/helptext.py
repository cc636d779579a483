"""The one `--help` style of every gpulens command: defaults shown (when there is one), examples
and other epilogs kept exactly as written."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action.default, list) and not action.default:
            return text
        return text + " (default: %(default)s)"
