"""Quantized weights held as stored (hpc_cli.model.quant_linear): the Linear layers of a FP8 or
NVFP4 checkpoint keep codes and scales, the memory count before loading matches what is held,
and the products equal the dequantised model's. On the CPU the product runs the reference path
(the weight dequantised for the one product), so a held model's logits equal the
dequantised-on-load model's exactly; the Triton kernels are checked in Triton's interpreter
(fp32) where triton is installed, and compiled on CUDA (tests marked gpu)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hpc_cli.cli import cli
from hpc_cli.model import HybridModel
from hpc_cli.model.footprint import HeldQuantized, check_fits, checkpoint_weights
from hpc_cli.model.layers import Linear
from hpc_cli.model.quant_linear import FP8Weight, NVFP4Weight, Residency, WeightsChoice, residency
from hpc_cli.model.quant_weights import UNQUANTIZED, Layout, QuantScheme, WeightFormat

from .helpers import F32, run_interpreted

TOKENS = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(5))


def _quantized(src: Path, out: Path, fmt: str) -> Path:
    res = CliRunner().invoke(cli, ["quantize", str(src), str(out), "--format", fmt, "--block-size", "32"])
    assert res.exit_code == 0, res.output
    return out


def _load(path: Path, weights: Residency) -> HybridModel:
    from hpc_cli.model.loader import load_checkpoint

    return load_checkpoint(path, dtype=torch.float32, progress=False, weights=weights)


def _held_bytes(model: HybridModel) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("fmt,kind", [("fp8", FP8Weight), ("nvfp4", NVFP4Weight)])
def test_held_weights_give_the_dequantised_models_logits_in_less_memory(hf_dense, tmp_path, fmt, kind):
    _, path = hf_dense
    out = _quantized(path, tmp_path / fmt, fmt)
    plain = _load(out, Residency.DEQUANTIZED)
    held = _load(out, Residency.QUANTIZED)
    linears = {n: m for n, m in held.named_modules() if isinstance(m, Linear)}
    quantized = {n for n, m in linears.items() if m.quant is not None}
    # every Linear the checkpoint stores quantized holds it as stored; lm_head, gates stay plain
    assert quantized and all(isinstance(linears[n].quant, kind) and linears[n].weight is None for n in quantized)
    assert "lm_head" not in quantized and not any(n.endswith(("in_proj_a", "in_proj_b")) for n in quantized)
    assert {n for n in linears if n.endswith(("q_proj", "out_proj", "down_proj"))} <= quantized
    assert not any(p.is_meta for p in held.parameters()), "a deferred weight was left unloaded"
    assert _held_bytes(held) < _held_bytes(plain)
    a = plain.forward_tokens(TOKENS, kv_profile=F32)
    b = held.forward_tokens(TOKENS, kv_profile=F32)
    assert torch.equal(a, b), f"held weights moved the logits by {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_held_moe_model_keeps_its_experts_dequantised(hf_moe, tmp_path, fmt):
    """Routed experts (fused parameters, not Linear layers) and the router are dequantised even
    when the dense Linear layers are held; the logits equal the dequantised model's."""
    _, path = hf_moe
    out = _quantized(path, tmp_path / fmt, fmt)
    plain = _load(out, Residency.DEQUANTIZED)
    held = _load(out, Residency.QUANTIZED)
    linears = {n: m for n, m in held.named_modules() if isinstance(m, Linear)}
    assert any(n.endswith("self_attn.q_proj") and m.quant is not None for n, m in linears.items())
    experts = [p for n, p in held.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert experts and all(p.dtype == torch.float32 and not p.is_meta for p in experts)
    a = plain.forward_tokens(TOKENS, kv_profile=F32)
    b = held.forward_tokens(TOKENS, kv_profile=F32)
    assert torch.equal(a, b), f"held weights moved the logits by {(a - b).abs().max():.3g}"


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_footprint_before_loading_is_what_the_held_model_holds(hf_dense, tmp_path, fmt):
    _, path = hf_dense
    out = _quantized(path, tmp_path / fmt, fmt)
    held = _load(out, Residency.QUANTIZED)
    weights = checkpoint_weights(out, torch.float32, device="cuda")
    assert weights.held_quantized and not weights.dequantized_on_load
    assert weights.resident_bytes == _held_bytes(held)
    assert weights.resident_bytes < checkpoint_weights(out, torch.float32).resident_bytes
    # the capacity check counts the same bytes, and names the held format when they do not fit
    from hpc_cli.errors import CapacityError
    from hpc_cli.model.config import ModelConfig

    config = ModelConfig.from_dir(out)
    names = frozenset(n for n, m in held.named_modules() if isinstance(m, Linear) and m.quant is not None)
    scheme = QuantScheme(WeightFormat.FP8, Layout.FP8_SCALE_INV, block=(32, 32)) if fmt == "fp8" else \
        QuantScheme(WeightFormat.NVFP4, Layout.COMPRESSED_TENSORS)
    spec = HeldQuantized(scheme, frozenset(n + ".weight" for n in names))
    need = _held_bytes(held)
    with pytest.raises(CapacityError, match=re.escape(f"for its {scheme.describe()} Linear and float32 weights")):
        check_fits("m", config, torch.float32, "cuda", with_mtp=False, held=spec,
                   available={"device": need - 1, "host": 1 << 40})
    assert check_fits("m", config, torch.float32, "cuda", with_mtp=False, held=spec,
                      available={"device": need, "host": 1 << 40}).device_bytes == need


def test_kv_table_shows_what_cuda_holds(hf_dense, tmp_path):
    _, path = hf_dense
    out = _quantized(path, tmp_path / "fp8", "fp8")
    res = CliRunner().invoke(cli, ["kv", "table", "--model", str(out), "--dtype", "float32", "--device", "cuda",
                                   "--json"])
    assert res.exit_code == 0, res.output
    w = json.loads(res.output)["weights"]
    assert (w["device"], w["held_quantized"], w["dequantized_on_load"]) == ("cuda", True, False)
    assert w["resident_bytes"] == _held_bytes(_load(out, Residency.QUANTIZED))
    text = CliRunner().invoke(cli, ["kv", "table", "--model", str(out), "--device", "cuda"]).output
    assert "held after loading on cuda" in text and "Linear weights kept as stored" in text
    text = CliRunner().invoke(cli, ["kv", "table", "--model", str(out), "--device", "cpu"]).output
    assert "(dequantised on load)" in text


def test_where_weights_are_held():
    fp8 = QuantScheme(WeightFormat.FP8, Layout.FP8_SCALE_INV, block=(128, 128))
    assert residency(fp8, "cpu") is Residency.DEQUANTIZED
    assert residency(UNQUANTIZED, "cuda") is Residency.DEQUANTIZED
    odd = QuantScheme(WeightFormat.FP8, Layout.FP8_SCALE_INV, block=(128, 48))  # no kernel takes 48-wide blocks
    assert residency(odd, "cuda") is Residency.DEQUANTIZED
    per_tensor = QuantScheme(WeightFormat.FP8, Layout.FP8_SCALE_INV, block=None)
    assert residency(per_tensor, "cuda") is Residency.DEQUANTIZED
    usable = importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
    assert residency(fp8, "cuda") is (Residency.QUANTIZED if usable else Residency.DEQUANTIZED)


def test_auto_holds_fp8_where_the_kernels_run_and_nvfp4_only_when_dequantised_it_does_not_fit(caplog):
    """[model] quantized_weights: auto holds FP8 wherever the kernels run (as fast as bf16, in half
    the memory), dequantises NVFP4 when it fits (its held kernels are slower) and holds it only when
    it does not, where the kernels can; held holds where the kernels can; dequantized never holds;
    a forced Residency wins; an unquantized checkpoint is never held. The kernels' check (a
    compile) is asked for only when its answer decides."""
    from hpc_cli.model.quant_linear import WeightsChoice, keep_quantized

    fp8 = QuantScheme(WeightFormat.FP8, Layout.FP8_SCALE_INV, block=(128, 128))
    nvfp4 = QuantScheme(WeightFormat.NVFP4, Layout.COMPRESSED_TENSORS, group_size=16)
    asked = []

    def answer(name: str, value: bool):
        def ask() -> bool:
            asked.append((name, value))
            return value
        return ask

    def keep(choice, scheme, holdable: bool, fits: bool) -> bool:
        return keep_quantized(choice, scheme, answer("holdable", holdable), answer("fits", fits))

    for choice in (None, WeightsChoice.AUTO):
        asked.clear()
        assert keep(choice, fp8, True, True) is True
        assert asked == [("holdable", True)]  # whether it fits does not matter
        asked.clear()
        assert keep(choice, fp8, False, True) is False  # nothing can hold them here
        assert keep(choice, fp8, False, False) is False
        assert asked == [("holdable", False), ("holdable", False)]
        asked.clear()
        assert keep(choice, nvfp4, True, True) is False
        assert asked == [("fits", True)]  # it fits: no kernel check
        asked.clear()
        assert keep(choice, nvfp4, True, False) is True
        assert keep(choice, nvfp4, False, False) is False  # nothing can hold them here
        assert asked == [("fits", False), ("holdable", True), ("fits", False), ("holdable", False)]
    asked.clear()
    assert keep(WeightsChoice.HELD, fp8, True, True) is True
    with caplog.at_level(logging.WARNING, logger="hpc_cli.model.quant_linear"):
        assert keep(WeightsChoice.HELD, fp8, False, True) is False
    assert "cannot be held as stored" in caplog.text
    assert asked == [("holdable", True), ("holdable", False)]  # held never asks whether they fit
    asked.clear()
    assert keep(WeightsChoice.DEQUANTIZED, fp8, True, False) is False
    assert keep(Residency.QUANTIZED, fp8, False, True) is True
    assert keep(Residency.DEQUANTIZED, fp8, True, False) is False
    assert keep(WeightsChoice.HELD, UNQUANTIZED, True, False) is False
    assert asked == []  # forced choices and unquantized checkpoints ask nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels build on CUDA")
def test_a_kernel_that_cannot_run_leaves_the_weights_dequantised(caplog):
    """Where the check cannot build or run the kernel (here: no CUDA device), the weights are
    dequantised on load, with a warning, instead of a load that fails."""
    from hpc_cli.model.quant_linear import kernels_check

    kernels_check.cache_clear()
    with caplog.at_level("WARNING", logger="hpc_cli.model.quant_linear"):
        assert kernels_check(WeightFormat.NVFP4, torch.device("cuda"), torch.bfloat16) is False
    assert "nvfp4 weight kernel failed its check" in caplog.text and "dequantised on load" in caplog.text


# -- the kernels in Triton's interpreter (a child process: TRITON_INTERPRET is read at import) ----

SHAPES = [(1, 200, 320), (3, 130, 256), (16, 64, 64), (2, 40, 1104), (17, 96, 160), (40, 130, 256)]
#: decode-sized products on the FP8 matrix units' tile (inputs in whole 128-input groups)
E4M3_SHAPES = [(1, 200, 384), (3, 130, 256), (16, 64, 1024), (5, 96, 640)]


def _child() -> dict:
    from hpc_cli.model.quant_weights import dequantize_fp8, dequantize_nvfp4, quantize_fp8, quantize_nvfp4
    from hpc_kernels.quant_gemm import fp8_decode_tile, fp8_linear, narrow_linear, nvfp4_linear, quantize_rows
    from hpc_kernels.split_sums import SplitSums, summed

    torch.manual_seed(0)
    out = []
    for m, n, k in SHAPES:
        w = torch.randn(n, k)
        x = torch.randn(m, k)
        for block in ((128, 128), (32, 64)):
            q, s = quantize_fp8(w, block)
            ref = x @ dequantize_fp8(q, s, block, torch.float32).T
            y = fp8_linear(x, q, s, block)
            alone = _rows_alone(lambda r: fp8_linear(r, q, s, block), x, y)
            # left as split sums (a decode-sized pass that splits K), they add up to the output
            unsummed = fp8_linear(x, q, s, block, unsummed=True)
            out.append({"fmt": f"fp8 {block}", "shape": [m, n, k], "err": float((y - ref).abs().max()),
                        "scale": float(ref.abs().max()), "rows_alone": alone,
                        "split_sums": isinstance(unsummed, SplitSums),
                        "split_sums_total": bool(torch.equal(summed(unsummed), y))})
        p, sc, g = quantize_nvfp4(w)
        ref = x @ dequantize_nvfp4(p, sc, float(1.0 / g), 16, torch.float32).T
        y = nvfp4_linear(x, p, sc, float(1.0 / g), 16)
        alone = _rows_alone(lambda r: nvfp4_linear(r, p, sc, float(1.0 / g), 16), x, y)
        out.append({"fmt": "nvfp4", "shape": [m, n, k], "err": float((y - ref).abs().max()),
                    "scale": float(ref.abs().max()), "rows_alone": alone})
    # bf16 rows on the FP8 matrix units' tile, each row's 128-input groups exact in e4m3 times a
    # power of two (so the interpreter's cast, below, is exact): the product of those rows (the
    # interpreter's e4m3 product is not exact, so the check is 1% of the largest output: a wrong
    # scale, group or split is off by its whole size)
    e4m3 = []
    for m, n, k in E4M3_SHAPES:
        w = torch.randn(n, k)
        x = _e4m3_exact_rows(m, k)
        for block in ((128, 128), (64, 256)):
            if not fp8_decode_tile(x.dtype, block, x.device).get("e4m3"):
                continue
            q, s = quantize_fp8(w, block)
            ref = x.float() @ dequantize_fp8(q, s, block, torch.float32).T
            y = fp8_linear(x, q, s, block)
            alone = _rows_alone(lambda r: fp8_linear(r, q, s, block), x, y)
            e4m3.append({"fmt": f"fp8 e4m3 {block}", "shape": [m, n, k], "scale": float(ref.abs().max()),
                         "err": float((y.float() - ref).abs().max()), "rows_alone": alone})
    # the codes themselves are compared on CUDA: the interpreter's float -> e4m3 cast rounds
    # values just below a power of two down a binade (124.3 -> 64), the hardware's does not
    x = torch.randn(5, 384) * torch.logspace(-3, 3, 384)
    q, s = quantize_rows(x, 128, rows=8)
    quant = {"scale_err": float((s[:5] * 448 / x.view(5, 3, 128).abs().amax(-1) - 1).abs().max()),
             "padding_zero": bool(q[5:].float().abs().sum() == 0 and s[5:].abs().sum() == 0),
             "column_major": s.stride() == (1, 8)}
    # a plain weight of few outputs (narrow_linear): fp32 rows and weight, so only the summation
    # order differs from torch's product
    narrow = []
    for m, n, k in [(1, 96, 5120), (5, 96, 640), (16, 40, 1104), (2, 256, 320)]:
        w, x = torch.randn(n, k), torch.randn(m, k)
        y, ref = narrow_linear(x, w), x @ w.T
        narrow.append({"shape": [m, n, k], "err": float((y - ref).abs().max()), "scale": float(ref.abs().max()),
                       "rows_alone": _rows_alone(lambda r: narrow_linear(r, w), x, y)})
    from hpc_kernels.quant_gemm import split_locks

    # each product's last split reset the counters the splits counted themselves in at
    locks_zero = bool((split_locks(torch.device("cpu")) == 0).all())
    return {"cases": out, "e4m3_cases": e4m3, "quantize_rows": quant, "locks_zero": locks_zero,
            "narrow": narrow}


def _e4m3_exact_rows(m: int, k: int) -> torch.Tensor:
    """``[m, k]`` bf16 rows whose every 128-input group is e4m3 codes times a power of two, its
    largest magnitude 448 times that power: quantized per group (``amax / 448``), they round to
    themselves."""
    g = torch.Generator().manual_seed(m * 7919 + k)
    codes = (torch.randn(m, k // 128, 128, generator=g) * 80).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    codes[:, :, 0] = 448.0 * torch.where(torch.rand(m, k // 128, generator=g) < 0.5, -1.0, 1.0)
    powers = 2.0 ** torch.randint(-12, 2, (m, k // 128, 1), generator=g).float()
    return (codes * powers).reshape(m, k).bfloat16()


def _rows_alone(f, x: torch.Tensor, y: torch.Tensor) -> bool:
    """A row's result does not depend on the other rows of its tile (the last row, the others
    zeroed: in the interpreter a tensor-core tile is numpy's product, whose rounding may depend
    on a row's place in it; on CUDA the row alone is compared too)."""
    if x.shape[0] > 16:
        return True
    alone = torch.zeros_like(x)
    alone[-1] = x[-1]
    return bool(torch.equal(f(alone)[-1], y[-1]))


def _splits_taken(n: int, k: int) -> int:
    from hpc_kernels.quant_gemm import TILES, k_splits

    tile = TILES["fp8"]
    return k_splits(n, k, tile["BN"], min(tile["BK"], 128), tile["waves"], 132)[0]  # a step: one scale block


#: the decode tile variants (the shipped one per format, and the others a sweep may choose)
TILE_VARIANTS = {"shipped": None,
                 "registers": {"BN": 16, "BK": 256, "num_warps": 4, "num_stages": 3, "waves": 8},
                 "swap": {"BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3, "waves": 4, "dot": True,
                          "swap": True}}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("variant", sorted(TILE_VARIANTS))
def test_interpreted_kernels_equal_the_dequantised_product(variant):
    doc = run_interpreted("tests.model.test_quant_linear", {"QUANT_TEST_TILE": json.dumps(TILE_VARIANTS[variant])})
    cases = doc["cases"]
    assert len(cases) == 3 * len(SHAPES)
    # the shipped FP8 tile multiplies bf16 rows on the FP8 matrix units (the other variants keep
    # the rows as they are)
    e4m3 = doc["e4m3_cases"]
    assert len(e4m3) == (2 * len(E4M3_SHAPES) if variant == "shipped" else 0), e4m3
    # the decode-sized shapes split K over programs (partial sums added by the second kernel)
    assert max(_splits_taken(n, k) for m, n, k in SHAPES if m <= 16) > 1
    # fp32 in (and bf16 rows that e4m3 holds exactly): only the summation order differs from the
    # reference product, and a row of up to 16 runs the same operations whatever the other rows
    # hold, so its numbers never depend on them
    bad = [c for c in cases if c["err"] > 1e-5 * max(1.0, c["scale"]) or not c["rows_alone"]]
    fp8 = [c for c in cases if c["fmt"].startswith("fp8")]
    bad += [c for c in fp8 if not c["split_sums_total"]]
    # the decode-sized passes that split K leave their split sums when asked
    assert any(c["split_sums"] for c in fp8) and not any(c["split_sums"] for c in fp8 if c["shape"][0] > 16)
    bad += [c for c in e4m3 if c["err"] > 1e-2 * c["scale"] or not c["rows_alone"]]
    assert not bad, bad
    assert doc["locks_zero"]
    assert not [c for c in doc["narrow"] if c["err"] > 1e-5 * max(1.0, c["scale"]) or not c["rows_alone"]], doc["narrow"]
    quant = doc["quantize_rows"]
    assert quant["scale_err"] <= 1e-6, quant  # one scale per row and 128 inputs: amax / 448
    assert quant["padding_zero"] and quant["column_major"], quant


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_kernels_on_cuda(dtype):
    from hpc_cli.model.quant_weights import dequantize_fp8, dequantize_nvfp4, quantize_fp8, quantize_nvfp4
    from hpc_kernels.quant_gemm import fp8_decode_tile, fp8_linear, nvfp4_linear

    torch.manual_seed(0)
    for m, n, k in SHAPES + [(16, 5120, 5120), (512, 1024, 5120)]:
        w = torch.randn(n, k, device="cuda")
        x = torch.randn(m, k, device="cuda").to(dtype)
        q, s = quantize_fp8(w, (128, 128))
        ref = x.float() @ dequantize_fp8(q, s, (128, 128), torch.float32).T
        y = fp8_linear(x, q, s, (128, 128))
        # a decode-sized pass on the FP8 matrix units rounds its rows to e4m3 (2-3%), as prefill does
        assert (y.float() - ref).abs().max() <= 5e-2 * ref.abs().max(), ("fp8", m, n, k)
        if m <= 16 and fp8_decode_tile(dtype, (128, 128), x.device).get("e4m3"):
            # the rows as the kernel rounds them, per 128 inputs (torch's cast: round to nearest even)
            xg = torch.nn.functional.pad(x.float(), (0, -k % 128)).view(m, -1, 128)
            xs = xg.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448
            xq = ((xg / xs).to(torch.float8_e4m3fn).float() * xs).view(m, -1)[:, :k]
            emu = xq @ dequantize_fp8(q, s, (128, 128), torch.float32).T
            assert (y.float() - emu).abs().max() <= 1e-2 * emu.abs().max(), ("fp8 e4m3", m, n, k)
        assert torch.equal(fp8_linear(x[-1:], q, s, (128, 128)), y[-1:]) or m > 16
        p, sc, g = quantize_nvfp4(w)
        ref = x.float() @ dequantize_nvfp4(p, sc, float(1.0 / g), 16, torch.float32).T
        y = nvfp4_linear(x, p, sc, float(1.0 / g), 16)
        assert (y.float() - ref).abs().max() <= 2e-2 * ref.abs().max(), ("nvfp4", m, n, k)
        assert torch.equal(nvfp4_linear(x[-1:], p, sc, float(1.0 / g), 16), y[-1:]) or m > 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_sums_finish_in_the_products_launch():
    """A decode-sized product whose K is split over many programs adds the partial sums in its
    own launch: the same bits on every run, eager or replayed from a CUDA graph whose input
    changed, whatever order the programs finished in, and the split counters zero after it."""
    from hpc_cli.model.quant_weights import quantize_fp8, quantize_nvfp4
    from hpc_kernels.quant_gemm import fp8_linear, nvfp4_linear, split_locks

    torch.manual_seed(0)
    w = torch.randn(5120, 17408, device="cuda")
    q, s = quantize_fp8(w, (128, 128))
    p, sc, g = quantize_nvfp4(w)
    factor = float(1.0 / g)  # a host number before any capture
    assert _splits_taken(5120, 17408) > 1
    for f in (lambda x: fp8_linear(x, q, s, (128, 128)), lambda x: nvfp4_linear(x, p, sc, factor, 16)):
        x = torch.randn(3, 17408, device="cuda", dtype=torch.bfloat16)
        first = f(x)
        assert all(torch.equal(f(x), first) for _ in range(100))
        static = torch.zeros_like(x)
        f(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = f(static)
        static.copy_(x)
        for _ in range(20):
            graph.replay()
            assert torch.equal(out, first)
        torch.cuda.synchronize()
        assert bool((split_locks(torch.device("cuda", torch.cuda.current_device())) == 0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_passes_run_on_the_fp8_tensor_cores():
    """A prefill-sized pass of a 128 x 128-block FP8 weight quantizes its rows to e4m3 per 128
    inputs (the codes equal torch's cast) and multiplies on the FP8 tensor cores where cuBLAS
    takes block scales; its error against the dequantised product is the activations' rounding."""
    from hpc_cli.model.quant_weights import dequantize_fp8, quantize_fp8
    from hpc_kernels.quant_gemm import fp8_linear, quantize_rows, scaled_mm_ready, scales_for_mm

    torch.manual_seed(0)
    x = torch.randn(37, 640, device="cuda", dtype=torch.bfloat16) * torch.logspace(-2, 2, 640, device="cuda")
    q, s = quantize_rows(x, 128, rows=40)
    xs = x.float().view(37, 5, 128)
    assert torch.allclose(s[:37], xs.abs().amax(-1) / 448, rtol=1e-6, atol=0)
    assert torch.equal(q[:37].view(torch.uint8), (xs / s[:37, :, None]).reshape(37, 640).to(torch.float8_e4m3fn).view(torch.uint8))
    if not scaled_mm_ready(x.device):
        pytest.skip("cuBLAS here takes no block-scaled FP8 product")
    for m, n, k in [(17, 96, 256), (40, 128, 384), (512, 1024, 5120)]:
        w = torch.randn(n, k, device="cuda")
        xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wq, ws = quantize_fp8(w, (128, 128))
        ref = xb.float() @ dequantize_fp8(wq, ws, (128, 128), torch.float32).T
        y = fp8_linear(xb, wq, ws, (128, 128), scales_for_mm(ws))
        # e4m3 rounds each input by up to 2^-4 of itself: about 2-3% of the largest output
        assert (y.float() - ref).abs().max() <= 5e-2 * ref.abs().max(), (m, n, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_held_model_on_cuda_agrees_with_the_dequantised_one(hf_dense, tmp_path, fmt):
    from hpc_cli.model.loader import load_checkpoint

    _, path = hf_dense
    out = _quantized(path, tmp_path / fmt, fmt)
    assert_held_agrees_on_cuda(out)
    # auto holds FP8 (as fast as bf16 or faster); the small model fits dequantised, so NVFP4
    # (slower held) is dequantised on load
    auto = load_checkpoint(out, dtype=torch.bfloat16, device="cuda", progress=False)
    held = any(isinstance(m, Linear) and m.quant is not None for m in auto.modules())
    assert held == (fmt == "fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_held_model_decodes_as_it_verifies(hf_dense, tmp_path):
    """Held FP8 weights through the column pass: decode (graphs, the output projections' split
    sums added by the next norm's launch) equals a verify pass over the same tokens bit for bit."""
    from hpc_cli.model.columns import columns_pass
    from hpc_cli.model.loader import load_checkpoint
    from hpc_kernels.quant_gemm import fp8_decode_tile, k_splits, sm_count

    _, path = hf_dense
    model = load_checkpoint(_quantized(path, tmp_path / "fp8", "fp8"), dtype=torch.bfloat16, device="cuda",
                            progress=False, weights=WeightsChoice.HELD)
    dev = torch.device("cuda", torch.cuda.current_device())
    held = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    tiles = [fp8_decode_tile(torch.bfloat16, m.quant.block, dev) for m in held]
    assert any(k_splits(m.out_features, m.in_features, t["BN"], min(t["BK"], m.quant.block[1]), t["waves"],
                        sm_count(dev))[0] > 1 for m, t in zip(held, tiles)), "no held product splits K"
    prompt, nxt = TOKENS[:60].tolist(), TOKENS[60:63].tolist()
    kv = model.new_kv_storage("bf16", 8)
    states = model.new_state_slots(3)
    model.prefill(prompt, 0, [0, 1], 0, kv, states)
    states.copy_slot(0, 1)
    dec = [model.decode([tok], [len(prompt) + j], [[0, 1]], [1], kv, states)[0].float() for j, tok in enumerate(nxt)]
    states.copy_slot(0, 2)
    ver = columns_pass(model, torch.tensor([nxt]), [len(prompt)], [[0, 1]], [2], kv, states, keep_all=True)
    assert torch.equal(torch.stack(dec), ver.logits[0].float())


def assert_held_agrees_on_cuda(path) -> None:
    """The checkpoint at ``path`` loads on CUDA with its Linear weights held as stored, and its
    logits agree with the dequantised load's (within the FP8 prefill's activation rounding)."""
    from hpc_cli.model.loader import load_checkpoint

    plain = load_checkpoint(path, dtype=torch.bfloat16, device="cuda", progress=False, weights=Residency.DEQUANTIZED)
    held = load_checkpoint(path, dtype=torch.bfloat16, device="cuda", progress=False, weights=WeightsChoice.HELD)
    assert any(isinstance(m, Linear) and m.quant is not None for m in held.modules())
    a = plain.forward_tokens(TOKENS.cuda(), kv_profile="bf16").float()
    b = held.forward_tokens(TOKENS.cuda(), kv_profile="bf16").float()
    assert (a - b).abs().max() <= 5e-2 * a.abs().max()


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    tile = json.loads(os.environ.get("QUANT_TEST_TILE") or "null")
    if tile is not None:  # a decode tile variant for both formats
        from hpc_kernels.quant_gemm import TILES

        TILES["fp8"] = TILES["nvfp4"] = tile
    print(json.dumps(_child()))
