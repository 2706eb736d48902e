"""`hpc-cli bench`: replay a trace of chat requests against each cache mode and compare them
(docs/cache-modes.md); `hpc-cli bench generate` writes seeded traces."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from hpc_cli.cli.groups import HelpGroup
from hpc_cli.errors import ConfigError

DEFAULT_MODES = "hybrid,legacy,off"


class BenchGroup(HelpGroup):
    """``hpc-cli bench TRACE ...`` is ``hpc-cli bench run TRACE ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group("bench", cls=BenchGroup)
def bench_group() -> None:
    """Compare cache modes on a trace: reuse, time to first token and residency, with plots
    (`hpc-cli bench TRACE --modes hybrid,legacy,off`)."""


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@bench_group.command("run")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--modes", default=DEFAULT_MODES, show_default=True, help="cache modes to compare, in order")
@click.option("--profile", default=None, help="a profile TOML for every mode (each mode keeps only its own "
                                              "[cache.<mode>] table)")
@click.option("--model", default=None, help="a checkpoint directory or builtin:NAME [model.name]")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="a profile key for every mode, e.g. --set engine.prefill_chunk=256 (repeatable)")
@click.option("--concurrency", default=1, show_default=True, type=click.IntRange(1, 256),
              help="sessions replayed at once (a session's requests stay in order)")
@click.option("--out", "out_dir", default="bench-out", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="folder for report.json and the plots")
@click.option("--base", default=None, metavar="URL",
              help="replay against a running server instead (its own cache mode; --modes is not used)")
@click.option("--api-key", default=None, envvar="HPC_BENCH_API_KEY", help="the server's API key (with --base)")
@click.option("--no-plots", is_flag=True, help="write report.json only")
def run_command(trace: Path, modes: str, profile: str | None, model: str | None, sets: tuple[str, ...],
                concurrency: int, out_dir: Path, base: str | None, api_key: str | None, no_plots: bool) -> None:
    """Replay TRACE (JSON Lines of chat requests) against each mode: an in-process engine per
    mode (or the server at --base), then print the table and write report.json and the plots."""
    from hpc_cli.bench.generate import read_trace
    from hpc_cli.bench.replay import EngineTarget, HttpTarget, ModeRun, replay
    from hpc_cli.bench.report import report, write_report
    from hpc_cli.bench.settings import mode_settings
    from hpc_cli.progress import step

    tf = read_trace(trace)
    overrides: dict[str, object] = {}
    for item in sets:
        key, eq, text = item.partition("=")
        if not eq or "." not in key:
            raise ConfigError(f"--set {item!r} is not KEY=VALUE with a dotted key",
                              hint="e.g. --set engine.prefill_chunk=256")
        overrides[key.strip()] = _value(text)
    if model is not None:
        overrides["model.name"] = model
    names = [m.strip() for m in modes.split(",") if m.strip()] if base is None else ["server"]
    if not names:
        raise ConfigError("--modes names no cache mode", hint=f"e.g. --modes {DEFAULT_MODES}")
    resolved = {m: mode_settings(profile, m, overrides) for m in names} if base is None else {}
    runs: list[ModeRun] = []
    n = len(tf.requests)
    for name in names:
        import time

        t0 = time.perf_counter()
        target = HttpTarget(base, api_key=api_key) if base is not None else EngineTarget(resolved[name])
        setup = time.perf_counter() - t0
        try:
            with step(f"bench {target.mode}: {n} requests", n, done=lambda s, m=target.mode: f"bench {m}: "
                      f"{n} requests in {s:.1f} s") as advance:
                run = replay(target, tf.requests, concurrency=concurrency, on_done=lambda _r: advance(1))
        finally:
            target.close()
        run.setup_s = setup
        runs.append(run)
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"{trace.name} ({tf.meta.get('kind', 'trace')})"
    plots: dict[str, str] = {}
    if not no_plots:
        from hpc_cli.bench.plots import write_plots

        plots = write_plots(runs, out_dir, title)
    settings = {m: {k: v for k, v in r.effective.items() if k.startswith(("model.", "engine.", "kv.", "cache."))}
                for m, r in resolved.items()}
    doc = report(runs, trace=str(trace), meta=tf.meta, settings=settings, plots=plots)
    write_report(doc, out_dir / "report.json")
    _print_table(runs, title)
    click.echo(f"report: {out_dir / 'report.json'}" + (f"; plots: {', '.join(plots.values())}" if plots else ""))


def _print_table(runs, title: str) -> None:
    from rich.table import Table

    from hpc_cli.bench.report import table_rows
    from hpc_cli.cli.output import print_table

    head, rows = table_rows(runs)
    table = Table(title=f"hpc-cli bench: {title}")
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    print_table(table)


@bench_group.command("generate")
@click.option("--kind", required=True, type=click.Choice(["multi-turn", "agent-loop", "shared-preamble", "edits"]),
              help="the traffic pattern")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--sessions", default=4, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--turns", default=4, show_default=True, type=click.IntRange(1, 1000),
              help="turns (agent steps) per session; shared-preamble: sessions x turns single-turn sessions")
@click.option("--preamble-tokens", default=1024, show_default=True, type=click.IntRange(1))
@click.option("--user-tokens", default="40-160", show_default=True, metavar="MIN-MAX")
@click.option("--answer-tokens", default="40-120", show_default=True, metavar="MIN-MAX",
              help="assistant answers (agent-loop: tool results) in the history")
@click.option("--max-tokens", default=8, show_default=True, type=click.IntRange(1))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def generate_command(kind: str, seed: int, sessions: int, turns: int, preamble_tokens: int, user_tokens: str,
                     answer_tokens: str, max_tokens: int, out: Path) -> None:
    """Write a seeded trace to OUT (JSON Lines): sizes in tokens of the embedded model."""
    from hpc_cli.bench.generate import GenerateConfig, generate, write_trace

    cfg = GenerateConfig(kind, seed, sessions, turns, preamble_tokens, _range(user_tokens, "--user-tokens"),
                         _range(answer_tokens, "--answer-tokens"), max_tokens)
    count = write_trace(generate(cfg), out)
    click.echo(f"wrote {count} requests ({kind}, seed {seed}) to {os.fspath(out)}")


def _range(text: str, flag: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not MIN-MAX", hint=f"e.g. {flag} 40-160") from None
    if not 1 <= a <= b:
        raise ConfigError(f"{flag} {text!r}: need 1 <= MIN <= MAX", hint=f"e.g. {flag} 40-160")
    return a, b


def register(cli: click.Group) -> None:
    cli.add_command(bench_group)
