"""`hpc-cli kv`: KV profiles and their bytes (spec §3.1)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from hpc_cli import plugins
from hpc_cli.cli.groups import HelpGroup
from hpc_cli.cli.output import echo_json, print_table, round_half_up
from hpc_cli.errors import ConfigError, HpcError
from hpc_cli.kv_profile import PAGE_TOKENS
from hpc_cli.shapes import PRESETS, HybridShape, preset

KiB = 1024
MiB = 1024 * 1024
GiB = 1024 * MiB


@click.group("kv", cls=HelpGroup)
def kv_group() -> None:
    """KV storage profiles."""


@kv_group.command("profiles")
@click.option("--head-dim", default=256, show_default=True, help="head dimension for the byte counts")
@click.option("--json", "as_json", is_flag=True)
def profiles_command(head_dim: int, as_json: bool) -> None:
    """List registered KV profiles with their record layout."""
    rows = []
    for entry in plugins.registries().kv_profiles:
        layout = entry.obj.layout(head_dim)
        rows.append({"name": entry.name, "aliases": list(entry.aliases), "plugin": entry.plugin,
                     "bytes_per_token_head": layout.bytes_per_token_head, "k_bytes": layout.k_bytes,
                     "v_bytes": layout.v_bytes,
                     "planes": [{"name": p.name, "bytes": p.bytes_per_token_head} for p in layout.planes],
                     "description": entry.obj.description})
    if as_json:
        echo_json(rows)
        return
    table = Table(title=f"KV profiles (head_dim {head_dim}, per token per KV head)")
    for col in ("profile", "aliases", "K B", "V B", "total B", "planes", "plugin"):
        table.add_column(col, justify="right" if col.endswith("B") else "left")
    for r in rows:
        table.add_row(r["name"], ", ".join(r["aliases"]), str(r["k_bytes"]), str(r["v_bytes"]),
                      str(r["bytes_per_token_head"]),
                      " ".join(f"{p['name']}:{p['bytes']}" for p in r["planes"]), r["plugin"])
    print_table(table)


def kv_table_rows(shape: HybridShape) -> list[dict]:
    """Spec §3.1's table for one model: bytes per token per head, per token, per 64-token page
    (profiles that cannot store the model's head_dim are left out)."""
    mtp = plugins.spec_backend("mtp")
    heads = shape.num_kv_heads * shape.num_attention_layers
    mtp_heads = shape.num_kv_heads * (shape.num_attention_layers + mtp.extra_main_kv_layers)
    rows = []
    for entry in plugins.registries().kv_profiles:
        try:
            b = entry.obj.layout(shape.head_dim).bytes_per_token_head
        except HpcError:
            continue  # a profile that cannot store this head_dim (e.g. groups of 64 for head_dim 32)
        rows.append({
            "profile": entry.name,
            "bytes_per_token_head": b,
            "bytes_per_token": b * heads,
            "kib_per_token": round_half_up(b * heads / KiB, 1),
            "bytes_per_page": b * heads * PAGE_TOKENS,
            "mib_per_page": round_half_up(b * heads * PAGE_TOKENS / MiB, 2),
            "mib_per_page_with_mtp": round_half_up(b * mtp_heads * PAGE_TOKENS / MiB, 2),
        })
    return rows


@kv_group.command("table")
@click.option("--model", "model", default="qwen3.5-27b", show_default=True,
              help=f"a model shape ({', '.join(sorted(PRESETS))}), builtin:NAME or a checkpoint directory (its "
                   "config.json; its weights' format and bytes are shown too, as for builtin:tiny)")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              show_default=True, help="with a checkpoint directory: the dtype its weights are held in once loaded "
                                      "(auto: as `serve` holds them, bfloat16 on cuda, float32 on cpu)")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="with a checkpoint directory: where its weights are held (auto: cuda when there is one); on "
                   "cuda a quantized checkpoint's Linear weights stay as stored")
@click.option("--json", "as_json", is_flag=True)
def table_command(model: str, dtype: str, device: str, as_json: bool) -> None:
    """Bytes per token and per 64-token page for a model shape (spec §3.1).

    With a checkpoint directory, also its weights: their format on disk, the bytes stored, and the
    bytes they hold once loaded: on CUDA a quantized checkpoint's (FP8, NVFP4) Linear weights stay as
    stored, elsewhere they are dequantised to the model dtype on load."""
    weights = None
    directory = model
    if model == "builtin:tiny":  # the embedded default: a checkpoint directory in the package
        from hpc_cli.model.builtin import TINY_DIR

        directory = str(TINY_DIR)
    if Path(directory).is_dir():
        import torch

        from hpc_cli.model.config import ModelConfig
        from hpc_cli.model.footprint import checkpoint_weights

        shape = ModelConfig.from_dir(directory).shape()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":  # serve's model.dtype = auto
            dtype = "bfloat16" if device == "cuda" else "float32"
        weights = checkpoint_weights(directory, getattr(torch, dtype), device=device)
    elif model in PRESETS:
        shape = preset(model)
    elif model.startswith("builtin:"):  # a seeded built-in: its shape (no weights on disk)
        from hpc_cli.model.builtin import builtin_config

        shape = builtin_config(model).shape()
    else:
        raise ConfigError(f"--model {model!r} is neither a model shape nor a checkpoint directory",
                          hint=f"choose one of: {', '.join(sorted(PRESETS))}, builtin:NAME (as `hpc-cli serve "
                               "--model` takes), or a directory with config.json")
    rows = kv_table_rows(shape)
    if as_json:
        data = {"model": model, "attention_layers": shape.num_attention_layers,
                "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "rows": rows}
        if weights is not None:
            data["weights"] = {"format": weights.format, "description": weights.description,
                               "stored_bytes": weights.stored_bytes, "resident_bytes": weights.resident_bytes,
                               "resident_dtype": weights.dtype, "dequantized_on_load": weights.dequantized_on_load,
                               "device": weights.device, "held_quantized": weights.held_quantized}
        echo_json(data)
        return
    table = Table(title=f"{model}: {shape.num_attention_layers} full-attention layers x "
                        f"{shape.num_kv_heads} KV heads, head_dim {shape.head_dim}")
    for col in ("profile", "per token/head", "per token", "page (64 tok)", "page + MTP"):
        table.add_column(col, justify="left" if col == "profile" else "right")
    for r in rows:
        table.add_row(r["profile"], f"{r['bytes_per_token_head']} B", f"{r['kib_per_token']} KiB",
                      f"{r['mib_per_page']} MiB", f"{r['mib_per_page_with_mtp']} MiB")
    print_table(table)
    if weights is not None:
        held = (f"{weights.format} Linear weights kept as stored, the rest {weights.dtype} (with "
                f"model.quantized_weights = held, or auto where dequantised they would not fit)"
                if weights.held_quantized
                else weights.dtype + (" (dequantised on load)" if weights.dequantized_on_load else ""))
        click.echo(f"weights on disk: {weights.description}, {_size(weights.stored_bytes)}; held after "
                   f"loading on {weights.device}: {_size(weights.resident_bytes)}, {held}")


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def register(cli: click.Group) -> None:
    cli.add_command(kv_group)
