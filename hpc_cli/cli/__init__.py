"""The ``hpc-cli`` command: one click group; each command group lives in its own module.

Errors users can cause are :class:`hpc_cli.errors.HpcError`: printed as ``error:`` and
``hint:`` lines without a traceback, exit status 2.
"""

from __future__ import annotations

import sys

import click

from hpc_cli import __version__
from hpc_cli.cli.groups import HelpGroup
from hpc_cli.errors import HpcError


class HpcClickError(click.ClickException):
    """Carries an HpcError through click so it prints as one clear message and exits 2."""

    def __init__(self, error: HpcError) -> None:
        super().__init__(error.message)
        self.error = error
        self.exit_code = error.exit_code

    def show(self, file=None) -> None:  # noqa: D102 - click's API
        click.echo(self.error.render(), err=True)


class HpcGroup(HelpGroup):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except HpcError as exc:
            raise HpcClickError(exc) from None


@click.group(cls=HpcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpc-cli")
def cli() -> None:
    """Serve hybrid-recurrent language models (Qwen3.5) with a hybrid prefix cache."""


def _register_builtin_commands() -> None:
    from hpc_cli.cli import config_cmd, kv_cmd, plugins_cmd

    for module in (plugins_cmd, kv_cmd, config_cmd):
        module.register(cli)
    for name in ("serve_cmd", "cache_cmd", "top_cmd", "expert_cmd", "cluster_cmd", "bench_cmd", "quantize_cmd"):
        try:
            module = __import__(f"hpc_cli.cli.{name}", fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != f"hpc_cli.cli.{name}":
                raise
            continue
        module.register(cli)


_register_builtin_commands()


def _add_plugin_commands() -> None:
    from hpc_cli import plugins

    plugins.add_commands(cli)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        _add_plugin_commands()
    except HpcError as exc:
        click.echo(exc.render(), err=True)
        sys.exit(exc.exit_code)
    cli.main(args=argv, prog_name="hpc-cli")
