"""The terminal console of the commands: rich's, made safe for names that come from files and databases.

Scenario, variant, client and model names reach table cells and lines, and rich reads ``[...]`` in a string as
markup: a scenario called ``[/red]`` would end the run in a ``MarkupError``. ``SafeConsole`` prints a string whose
markup is malformed as plain text instead; well-formed markup (the commands' own ``[red]FAIL[/red]``) is kept.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.errors import MarkupError
from rich.text import Text


class SafeConsole(Console):
    """A ``rich.console.Console`` that never fails on a string's markup."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        try:
            return super().render_str(text, **kwargs)
        except MarkupError:
            return super().render_str(text, **{**kwargs, "markup": False})
