"""The ``tspd`` command.

Subcommands live in their own modules and are imported only when invoked, so a
broken optional dependency of one command never breaks the others.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

__all__ = ["LazyGroup", "main"]

# name -> "module:attribute" of a click command or group.
_COMMANDS: dict[str, str] = {
    "wire": "tspd.cli.wire:wire",
    "bench": "tspd.cli.bench:bench",
    "events": "tspd.cli.events:events",
    "diagrams": "tspd.cli.diagrams:diagrams",
    "demo": "tspd.cli.demo:demo",
    "bootstrap-server": "tspd.cli.demo:bootstrap_server",
    "trace": "tspd.cli.trace:trace",
    "keys": "tspd.cli.keys:keys",
    "sim": "tspd.cli.sim:sim",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self._lazy:
            module_name, attr = self._lazy[cmd_name].split(":")
            command = getattr(importlib.import_module(module_name), attr)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, lazy=_COMMANDS)
@click.version_option(package_name="tspd")
def main() -> None:
    """tspd: the prefill/decode KV-transfer control plane (TokenSpeed wire-compatible)."""
