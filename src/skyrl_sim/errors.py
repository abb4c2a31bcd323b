"""User-facing errors: each names the file, the key path and the reason, and the CLI prints it without a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user gave us (a file, a flag, a value). The CLI prints it and exits with code 2."""


class ScenarioError(UserError):
    """A scenario or endpoint file that cannot be used as written."""

    def __init__(self, path: str, key: str, reason: str) -> None:
        self.path = path
        self.key = key
        self.reason = reason
        where = f"{path}" + (f", key '{key}'" if key else "")
        super().__init__(f"{where}: {reason}")


class PluginError(UserError):
    """Two plugins claim one name, or a plugin cannot be loaded."""
