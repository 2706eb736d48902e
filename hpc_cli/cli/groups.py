"""The click group class of every ``hpc-cli`` command group: its command list shows each
command's whole first sentence, wrapped to the terminal, never cut with ``...``."""

from __future__ import annotations

import click

#: longer than any first sentence: click cuts a short help at this many characters
NO_LIMIT = 10_000


class HelpGroup(click.Group):
    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(NO_LIMIT)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
