"""`hpc-cli quantize`: write an FP8 or NVFP4 copy of a bf16 checkpoint (docs/quantized-weights.md)."""

from __future__ import annotations

from pathlib import Path

import click

from hpc_cli.cli.output import echo_json


@click.command("quantize")
@click.argument("src", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", metavar="OUT", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["fp8", "nvfp4"]), required=True,
              help="fp8: float8_e4m3fn with a float32 scale per block (transformers' FineGrainedFP8 layout); "
                   "nvfp4: e2m1 with an e4m3 scale per 16 inputs and a global scale (compressed-tensors layout)")
@click.option("--block-size", "block", default=128, show_default=True,
              help="fp8 only: rows and columns of one scale block; matrices whose dims are not multiples of it "
                   "stay unquantized")
@click.option("--force", is_flag=True, help="write into OUT even when it is not empty (its old shards are removed)")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
def quantize_command(src: Path, out: Path, fmt: str, block: int, force: bool, as_json: bool) -> None:
    """Write a quantized copy of the bf16/fp32 Qwen3.5 checkpoint DIR to OUT.

    Quantized: the Linear weights of attention, the Gated DeltaNet projections and the MLPs and
    experts. Embeddings, lm_head, norms, conv1d, in_proj_a/b, routers and the vision tower stay as
    stored and are listed in the quantization_config that config.json gains; tokenizer and other
    files are copied. hpc-cli dequantises these weights on load: the served model takes the memory
    and runs at the speed of the bf16 model."""
    from hpc_cli.model.quant_weights import WeightFormat
    from hpc_cli.model.quantize import quantize_checkpoint

    result = quantize_checkpoint(src, out, WeightFormat(fmt), block=block, force=force, progress=True)
    summary = {"out": str(out), "format": fmt, "quantized_tensors": result.quantized, "kept_tensors": result.kept,
               "bytes_in": result.bytes_in, "bytes_out": result.bytes_out, "not_converted": list(result.not_convert)}
    if as_json:
        echo_json(summary)
        return
    click.echo(f"wrote {out}: {result.quantized} tensors quantized to {fmt}, {result.kept} kept as stored; "
               f"{result.bytes_in / 2**20:.1f} MiB -> {result.bytes_out / 2**20:.1f} MiB")


def register(cli: click.Group) -> None:
    cli.add_command(quantize_command)
