"""The `meshrl` command: serve a role, bring a whole mesh up, drive and watch runs, plot metrics. The commands
live in runs.py (up, run), mesh.py (mesh) and manage.py (status ... profile-model); importing them registers them on the one app
(common.py). `python -m coordinator.cli` is the same command."""

from __future__ import annotations

import importlib

import typer

from coordinator.cli.common import PASSTHROUGH, app, command
from services.common.roles import PACKAGES

ROLES = {role: f"{package}.__main__" for role, package in PACKAGES.items()}


@command(context_settings=PASSTHROUGH)
def serve(ctx: typer.Context,
          role: str = typer.Argument(..., help=", ".join(PACKAGES))):
    """Run one service: `meshrl serve rollout --config FILE [--port N] [--section.key value ...]`."""
    if role not in ROLES:
        raise typer.BadParameter(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", param_hint="ROLE")
    importlib.import_module(ROLES[role]).main(list(ctx.args))


# Imported after `serve`, runs before manage: the order `meshrl --help` lists the commands in.
from coordinator.cli import runs  # noqa: E402,F401
from coordinator.cli import mesh  # noqa: E402,F401,I001
from coordinator.cli import manage  # noqa: E402,F401,I001


def main() -> None:  # pragma: no cover
    app()
