"""`hpc-cli expert`: routing traces, residency profiles and their hit rates (docs/expert-profile.md).

``record`` runs a model over a prompt file and writes its routing trace (a server writes one
while serving with ``[experts] trace_file``); ``profile`` ranks the (layer, expert) pairs of
traces into an STRP file; ``score`` says what a profile hits on a trace, in-sample and ten-fold
held out. ``hpc-cli cache inspect profile.bin`` summarises a profile.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from hpc_cli.cli.groups import HelpGroup
from hpc_cli.cli.output import console, echo_json, print_table
from hpc_cli.errors import ConfigError
from hpc_cli.kv_profile import PAGE_TOKENS
from hpc_cli.model import expert_profile as ep


@click.group("expert", cls=HelpGroup)
def expert_group() -> None:
    """MoE expert tier: routing traces, residency profiles, hit rates."""


@expert_group.command("record")
@click.argument("prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="routing trace to write (HPCT)")
@click.option("--model", "model_name", default="builtin:tiny-moe", show_default=True,
              help="a Qwen3.5-MoE checkpoint directory or builtin:NAME")
@click.option("--decode", "decode_tokens", default=0, show_default=True, help="greedy tokens to decode per prompt")
@click.option("--max-prompt-tokens", default=4096, show_default=True, help="truncate longer prompts")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True)
@click.option("--offload-experts", is_flag=True,
              help="keep the routed experts in host memory and compute them there (a model whose experts "
                   "do not fit the device)")
@click.option("--json", "as_json", is_flag=True)
def record_command(prompts: Path, out: Path, model_name: str, decode_tokens: int, max_prompt_tokens: int,
                   device: str, dtype: str, offload_experts: bool, as_json: bool) -> None:
    """Run MODEL over PROMPTS (one prompt per line) and write the routing of every token.

    To record while serving instead, set `[experts] trace_file = "trace.bin"` (or
    HPC_EXPERTS__TRACE_FILE) and run `hpc-cli serve`."""
    import torch

    from hpc_cli.model import HybridModel
    from hpc_cli.experts.tier import ExpertTier

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dt = None if dtype == "auto" else getattr(torch, dtype)
    model = HybridModel.from_name_or_path(model_name, dtype=dt, device=device, progress=not as_json,
                                          offload_experts=offload_experts)
    if not model.config.is_moe:
        raise ConfigError(f"{model_name} is a dense model: it routes no experts",
                          hint="record a qwen3_5_moe checkpoint (builtin:tiny-moe to try the tools)")
    lines = [ln.strip() for ln in prompts.read_text().splitlines() if ln.strip()]
    if not lines:
        raise ConfigError(f"{prompts} holds no prompts", hint="write one prompt per line")
    tier = ExpertTier(model, offload=False, trace_file=out)
    tok = model.tokenizer
    try:
        for text in lines:
            ids = tok.encode(text)[:max_prompt_tokens]
            _run_prompt(model, ids, decode_tokens)
    finally:
        tier.close()
    result = {"trace": str(out), "prompts": len(lines), "tokens": tier.tokens, "model": model.config.name,
              "n_layers": tier.n_layers, "n_expert": tier.n_expert, "top_k": tier.top_k}
    if as_json:
        echo_json(result)
    else:
        click.echo(f"wrote {out}: {tier.tokens} tokens of {len(lines)} prompts, {tier.n_layers} layers x "
                   f"{tier.n_expert} experts, top {tier.top_k}")


def _run_prompt(model, ids: list[int], decode_tokens: int) -> None:
    page = PAGE_TOKENS
    n_pages = (len(ids) + decode_tokens + page - 1) // page + 1
    kv = model.new_kv_storage("bf16", n_pages, name="scratch")
    states = model.new_state_slots(1)
    table = list(range(n_pages))
    out = model.prefill(ids, 0, table, 0, kv, states)
    nxt = int(out.logits.argmax())
    for i in range(decode_tokens):
        logits = model.decode([nxt], [len(ids) + i], [table], [0], kv, states)
        nxt = int(logits[0].argmax())


@expert_group.command("profile")
@click.argument("traces", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--slots", required=True, type=click.IntRange(min=0), help="device slots the profile is built for")
@click.option("-o", "--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="profile to write (STRP)")
@click.option("--json", "as_json", is_flag=True)
def profile_command(traces: tuple[Path, ...], slots: int, out: Path, as_json: bool) -> None:
    """Rank the (layer, expert) pairs of TRACES by routing frequency into an STRP profile."""
    trace = ep.read_traces(list(traces))
    prof = ep.build_profile(trace.counts(), slots)
    ep.write_profile(out, prof)
    e, l, _ = ep.hit_rates(trace.records, prof.resident_mask())
    result = {"profile": str(out), "tokens": trace.tokens, "n_layers": prof.n_layers, "n_expert": prof.n_expert,
              "slots": slots, "n_ranked": prof.n_ranked, "h_expert_in_sample": e, "h_layer_in_sample": l}
    if as_json:
        echo_json(result)
    else:
        click.echo(f"wrote {out}: {prof.n_ranked} ranked pairs from {trace.tokens} tokens, {slots} slots; "
                   f"in-sample h_expert {e:.4f}, h_layer {l:.4f} (`hpc-cli expert score` for held-out)")


@expert_group.command("score")
@click.argument("profile", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("traces", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--slots", type=click.IntRange(min=0), default=None, help="score this many slots (default the profile's)")
@click.option("--folds", default=10, show_default=True, type=click.IntRange(min=1),
              help="k of the leave-one-fold-out estimate (1: none)")
@click.option("--json", "as_json", is_flag=True)
def score_command(profile: Path, traces: tuple[Path, ...], slots: int | None, folds: int, as_json: bool) -> None:
    """Hit rates of PROFILE on TRACES: h_expert, h_layer, and k-fold held-out h with its spread."""
    prof = ep.read_profile(profile)
    trace = ep.read_traces(list(traces))
    res = ep.score(prof, trace, slots=slots, folds=folds)
    if as_json:
        echo_json(res)
        return
    con = console()
    t = Table(title=f"{profile} on {trace.tokens} tokens ({res['slots']} slots of "
                    f"{prof.n_layers * prof.n_expert})", show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("h_expert (this profile)", f"{res['h_expert']:.4f}")
    t.add_row("h_layer (this profile)", f"{res['h_layer']:.4f}")
    kf = res.get("kfold")
    if kf:
        t.add_row(f"h_expert held out ({kf['folds']}-fold)",
                  f"{kf['h_expert']:.4f} [{kf['h_expert_min']:.4f}, {kf['h_expert_max']:.4f}] "
                  f"sd {kf['h_expert_std']:.4f}")
        t.add_row(f"h_layer held out ({kf['folds']}-fold)",
                  f"{kf['h_layer']:.4f} [{kf['h_layer_min']:.4f}, {kf['h_layer_max']:.4f}]")
    for name, h in res["policies"].items():
        t.add_row(f"h_expert, admission {name}", f"{h:.4f}")
    print_table(t, con)
    layers = Table(title="h_expert per layer")
    layers.add_column("layer", justify="right")
    layers.add_column("h_expert", justify="right")
    for i, h in enumerate(res["h_expert_per_layer"]):
        layers.add_row(str(i), f"{h:.4f}")
    print_table(layers, con)


def inspect_profile(file: Path, as_json: bool, top: int) -> None:
    """`hpc-cli cache inspect` on an STRP file: header, per-layer residency, top experts."""
    summ = ep.summarize_profile(ep.read_profile(file), top=top)
    summ["path"] = str(file)
    if as_json:
        echo_json(summ)
        return
    con = console()
    t = Table(title=f"expert residency profile {file}", show_header=False)
    t.add_column("field")
    t.add_column("value")
    t.add_row("format", f"STRP v{summ['version']}")
    t.add_row("shape", f"{summ['n_layers']} layers x {summ['n_expert']} experts")
    t.add_row("slots", str(summ["slots"]))
    t.add_row("ranked pairs", str(summ["n_ranked"]))
    t.add_row("resident at its slots", str(summ["resident"]))
    t.add_row("routed picks counted", str(summ["routed_total"]))
    t.add_row("h_expert in sample", f"{summ['h_expert_in_sample']:.4f}")
    print_table(t, con)
    pl = Table(title="per-layer residency")
    for col in ("layer", "resident", "routed", "h_expert in sample"):
        pl.add_column(col, justify="right")
    for r in summ["per_layer"]:
        pl.add_row(str(r["layer"]), str(r["resident"]), str(r["routed"]), f"{r['h_expert_in_sample']:.4f}")
    print_table(pl, con)
    tp = Table(title=f"top {len(summ['top'])} experts")
    for col in ("rank", "layer", "expert", "count", "share"):
        tp.add_column(col, justify="right")
    for r in summ["top"]:
        tp.add_row(str(r["rank"]), str(r["layer"]), str(r["expert"]), str(r["count"]), f"{r['share']:.4f}")
    print_table(tp, con)


def register(cli: click.Group) -> None:
    cli.add_command(expert_group)
