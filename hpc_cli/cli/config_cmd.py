"""`hpc-cli config`: show and validate profile files."""

from __future__ import annotations

import click
from rich.table import Table

from hpc_cli.cli.groups import HelpGroup
from hpc_cli.cli.output import echo_json, print_table
from hpc_cli.settings import env_var, load_settings


@click.group("config", cls=HelpGroup)
def config_group() -> None:
    """Profile files: effective values, where they come from, validation."""


@config_group.command("show")
@click.option("--profile", "profile", metavar="FILE", help="a profile path or a shipped profile name")
@click.option("--sources", is_flag=True, help="show which layer set each value")
@click.option("--json", "as_json", is_flag=True)
def show_command(profile: str | None, sources: bool, as_json: bool) -> None:
    """Every effective value (derived ones included) for a profile plus the environment."""
    r = load_settings(profile)
    if as_json:
        data = {"profile": str(r.profile_path) if r.profile_path else None,
                "values": r.effective}
        if sources:
            data["sources"] = r.sources
        echo_json(data)
        return
    table = Table(title=f"effective settings ({r.profile_path or 'defaults'})")
    table.add_column("key")
    table.add_column("value")
    if sources:
        table.add_column("source")
        table.add_column("env var")
    for key, value in r.effective.items():
        row = [key, "" if value is None else str(value)]
        if sources:
            row += [r.sources[key], env_var(key)]
        table.add_row(*row)
    print_table(table)


@config_group.command("validate")
@click.argument("file")
def validate_command(file: str) -> None:
    """Check a profile file (and the environment) without starting anything: every bad value,
    unknown plugin name and missing path, all reported at once."""
    from hpc_cli.profile_check import ProfileProblems, check_profile

    problems = check_profile(file)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ProfileProblems(problems)
    r = load_settings(file)
    s = r.settings
    click.echo(f"ok: {r.profile_path}: model {s.model.name}, kv {s.kv.profile}, "
               f"speculative {s.speculative.backend}, cache {s.cache.mode} "
               f"(host {s.cache.host_cache_mib} MiB)")


@config_group.command("reference")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="write to a file instead of stdout")
def reference_command(output: str | None) -> None:
    """Every profile key with its type, default, environment variable and meaning (Markdown)."""
    from hpc_cli.config_reference import reference_markdown

    text = reference_markdown()
    if output:
        with open(output, "w") as f:
            f.write(text)
    else:
        click.echo(text, nl=False)


def register(cli: click.Group) -> None:
    cli.add_command(config_group)
