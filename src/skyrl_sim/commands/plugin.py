"""The built-in commands beyond ``run``, ``check`` and ``plugins``, registered through ``skyrl_sim_commands`` like any
plugin's: the CLI registers this plugin on the host it builds, so the host itself imports no command."""

from __future__ import annotations

from typing import Any

from skyrl_sim.plugin_host.hookspecs import hookimpl

BUILTIN_COMMANDS = "commands"
"""The name the built-in commands plugin is registered under."""


class BuiltinCommands:
    """sweep, compare, calibrate, advise, import, replay, endpoints and schema: each module adds its own parser."""

    @hookimpl
    def skyrl_sim_commands(self, subparsers: Any) -> None:
        from skyrl_sim.commands import advise, calibrate, catalog, compare, importer, replay, sweep  # each beside its logic

        sweep.add_parser(subparsers)
        compare.add_parser(subparsers)
        calibrate.add_parser(subparsers)
        advise.add_parser(subparsers)
        importer.add_parser(subparsers)
        replay.add_parser(subparsers)
        catalog.add_parser(subparsers)
