"""`hpc-cli plugins`: what is loaded, from where, and what it registers."""

from __future__ import annotations

import click
from rich.table import Table

from hpc_cli import hookspecs, plugins
from hpc_cli.cli.output import echo_json, print_table
from hpc_cli.errors import PluginError

HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("hpc_"))


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
@click.option("--hook", "hook", metavar="NAME", help="only plugins implementing this hook")
def plugins_command(as_json: bool, hook: str | None) -> None:
    """List loaded plugins, their versions, hooks and what they register."""
    if hook is not None and hook not in HOOKS:
        raise PluginError(f"unknown hook {hook!r}", hint=f"hooks: {', '.join(HOOKS)}")
    info = plugins.plugin_info()
    if hook:
        info = [p for p in info if hook in p["hooks"]]
    if as_json:
        echo_json(info)
        return
    table = Table(title="hpc-cli plugins")
    for col in ("plugin", "version", "hooks", "registers"):
        table.add_column(col)
    for p in info:
        regs = "; ".join(f"{k}: {', '.join(v)}" for k, v in p["registers"].items())
        name = p["name"] + (" (built-in)" if p["builtin"] else "")
        table.add_row(name, p["version"] or "?", "\n".join(p["hooks"]), regs)
    print_table(table)


def register(cli: click.Group) -> None:
    cli.add_command(plugins_command)
