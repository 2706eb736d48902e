"""The Triton KV kernels run by Triton's CPU interpreter (TRITON_INTERPRET=1) against the torch
reference, without a GPU: byte-exact codes and scales, equal non-finite counts, equal dequantised
values, for every built-in profile side, on both quantisation paths (CONFIG["fast_div"] True:
the reciprocal quotient with its one or two remainder corrections; False: a div_rn per value).

Data: Gaussian and outlier channels in fp32, fp16 and bf16; special values (NaN, +-inf, -0, zero
rows, huge, tiny and subnormal); exact ties (x / s a midpoint of the code grid) and values one ulp
off a tie; NVFP4 also with global scales that make S * g inexact, subnormal, or overflowing.

The interpreter has to be chosen before triton is imported, and a pytest run may already have
imported it for the GPU, so the kernels run in a child process (this file run as a script) and
the tests check its JSON report. Interpreter limits: its fp32 -> bf16 cast truncates (the GPU
rounds to nearest even), so the bf16 format is fed bf16-representable values and gathers are
checked in fp32 and fp16 only; test_gpu.py checks the rest on the GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvtest_util import (HEAD_DIM, PROFILES, gaussian, gs_for,  # noqa: E402
                         outlier_channels, special_values, tie_data)

#: Values per program in the interpreter: 16 rows of 256, so a run of TOKENS tokens x 4 heads has
#: several programs.
BLOCK_VALUES = 4096
TOKENS = 16
#: NVFP4 global scales beyond the defaults: inexact S * g; subnormal S * g (inv = inf); S * g above
#: 2^126 for a saturated block (inv subnormal; the special data's inf); S * g overflowing to inf
#: (inv = 0; the tie data's largest groups overflow to inf themselves).
ODD_GLOBAL_SCALES = (float(torch.tensor(0.3, dtype=torch.float32)), 2.0 ** -140, 2.0 ** 118, 2.0 ** 123)


def _formats() -> list[tuple[str, object, float | None]]:
    """(label, SideFormat, global scale): every built-in profile side once, plus NVFP4 with odd
    global scales."""
    out, seen = [], set()
    for name, prof in PROFILES.items():
        for side in ("k", "v"):
            fmt, gs = prof.side_format(side, HEAD_DIM), gs_for(prof, side)
            if (fmt, gs) not in seen:
                seen.add((fmt, gs))
                out.append((f"{name}/{side}", fmt, gs))
    nv = PROFILES["nvfp4-g16"].side_format("k", HEAD_DIM)
    out += [(f"nvfp4-g16/gs={gs:g}", nv, gs) for gs in ODD_GLOBAL_SCALES]
    return out


def _datasets(fmt, gs, label: str) -> dict[str, tuple[torch.Tensor, bool]]:
    """name -> (input, whether the exact-division path runs it too). The gathers run on the
    ``*_fp32`` Gaussian and special data."""
    n = TOKENS
    if fmt.kind == "bf16":
        # bf16-representable values only, and no subnormals: the interpreter's fp32 -> bf16 cast
        # truncates and flushes subnormals (see the module doc).
        sp = special_values(n=n)
        sp = torch.where((sp.abs() < 2.0 ** -126) & (sp != 0), 0.0, sp).to(torch.bfloat16)
        big = sp.float()
        big[:, :, 7::16] = 3.4e38  # finite fp32 above BF16_MAX (3.39e38): clamped to it
        return {"gauss_bf16": (gaussian(n=n), True), "special_bf16": (sp, True), "special_fp32": (big, True)}
    odd = "gs=" in label
    data = {"gauss_fp32": (gaussian(n=n, dtype=torch.float32), False),
            "ties_fp32": (tie_data(fmt, gs, n=n), not odd),
            "near_ties_fp32": (tie_data(fmt, gs, n=n, seed=4, nudge=True), False),
            "special_fp32": (special_values(n=n), True)}
    if odd:
        return data
    out, _ = outlier_channels(n=n, dtype=torch.float32)
    data.update({
        "gauss_bf16": (gaussian(n=n), False), "gauss_fp16": (gaussian(n=n, dtype=torch.float16), False),
        "outliers_fp32": (out, False), "outliers_bf16": (out.to(torch.bfloat16), False),
        "special_fp16": (special_values(n=n).to(torch.float16), False),
        "special_bf16": (special_values(n=n).to(torch.bfloat16), False),
        "ties_fp16": (tie_data(fmt, gs, n=n, seed=5).to(torch.float16), False),
        "ties_bf16": (tie_data(fmt, gs, n=n, seed=6).to(torch.bfloat16), False),
    })
    return data


def _slots(n: int) -> torch.Tensor:
    """Token i -> a shuffled slot among n + 8, two tokens skipped (negative slot)."""
    g = torch.Generator().manual_seed(n)
    slots = torch.randperm(n + 8, generator=g)[:n]
    slots[3] = -1
    slots[n - 2] = -5
    return slots


def _fix_interpreter_fma() -> bool:
    """Triton 3.6's interpreter computes ``tl.fma`` as ``x * y + z``, rounding twice (3.9's rounds
    once, as compiled code does: ``fma.rn.f32``); the kernels' tie test needs one rounding. Where
    the probe shows two, compute fp32 fmas through float64: the product of two fp32 values is
    exact there, and for the remainders of the kernels' quotient so is the sum (x - y s cancels
    to a few bits), so the one rounding is the final one to fp32. Returns whether it patched."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    one = np.float32(1 + 2.0 ** -12)

    def handle(v):
        return interpreter.TensorHandle(np.array([v], dtype=np.float32), interpreter.tl.float32)

    if builder.create_fma(handle(one), handle(one), handle(-(1 + 2.0 ** -11))).data[0] != 2.0 ** -24:
        plain = type(builder).create_fma

        def create_fma(self, x, y, z):
            if x.data.dtype != np.float32:
                return plain(self, x, y, z)
            exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
            return interpreter.TensorHandle(exact.astype(np.float32), z.dtype.scalar)

        type(builder).create_fma = create_fma
        return True
    return False


def _child() -> dict:
    """Run every case through the interpreted kernels (TRITON_INTERPRET=1 is set by the parent)."""
    from hpc_kernels import kv_quant, kv_quant_ref as ref
    from hpc_kernels import kv_quant_triton as kt

    kt.CONFIG["block_values"] = BLOCK_VALUES

    def run(fmt, x, gs):
        n, h, d = x.shape
        slots = _slots(n)
        planes = [torch.zeros(n + 8, h, b, dtype=torch.uint8) for b in fmt.plane_bytes(d)]
        counter = torch.zeros((), dtype=torch.int32)
        keep = slots >= 0
        kt.quantize_into(fmt, x, slots, planes, 1.0 if gs is None else gs, counter)
        want = ref.quantize(fmt, x[keep], gs)
        got = [p[slots[keep]] for p in planes]
        mism = sum(int((a != b).sum()) for a, b in zip(got, want))
        count_ok = int(counter) == int(ref.count_nonfinite(x[keep]))  # a skipped token is not read
        return mism, count_ok, planes, slots[keep], want

    report = {"cases": {}, "uncorrected": {}, "patched_fma": _fix_interpreter_fma()}
    for label, fmt, gs in _formats():
        cases = report["cases"][label] = []
        data = _datasets(fmt, gs, label)
        for name, (x, both) in data.items():
            for fast in [True] + ([False] if both else []):
                kt.CONFIG["fast_div"] = fast
                mism, count_ok, planes, slots, want = run(fmt, x, gs)
                rec = {"data": name, "fast_div": fast, "mismatches": mism, "count_ok": count_ok}
                if fast and name in ("gauss_fp32", "special_fp32"):
                    gsf = 1.0 if gs is None else gs
                    rec["gather_equal"] = {}
                    for dtype in (torch.float32, torch.float16):
                        out = kt.dequantize_slots(fmt, planes, slots, HEAD_DIM, dtype, gsf)
                        exp = ref.dequantize(fmt, want, dtype, gs)
                        bits = torch.int16 if dtype == torch.float16 else torch.int32
                        rec["gather_equal"][str(dtype)] = bool(torch.equal(out.view(bits), exp.view(bits)))
                    # by page table: pages of 4 slots in a shuffled order, a ragged last page
                    page_ids = torch.randperm((TOKENS + 8) // 4, generator=torch.Generator().manual_seed(1))
                    k = TOKENS + 1
                    by_pages = kt.dequantize_slots(fmt, planes, page_ids, HEAD_DIM, torch.float32, gsf,
                                                   page_tokens=4, n_tokens=k)
                    by_slots = kt.dequantize_slots(fmt, planes, kv_quant.page_slots(page_ids, k, 4), HEAD_DIM,
                                                   torch.float32, gsf)
                    rec["gather_equal"]["pages"] = bool(torch.equal(by_pages, by_slots)) and by_pages.shape[0] == k
                cases.append(rec)
        kt.CONFIG["fast_div"] = True
        if fmt.kind != "bf16" and "gs=" not in label:
            # The fast quotient without its corrections (y = x * inv): the tie data must then
            # mismatch, so it reaches the cases the corrections are for.
            kt._quotient = _uncorrected_quotient
            try:
                report["uncorrected"][label] = [run(fmt, data[name][0], gs)[0]
                                                for name in ("ties_fp32", "near_ties_fp32")]
            finally:
                kt._quotient = _QUOTIENT
    return report


def _uncorrected_quotient(x, s, inv, STEPS):
    return x * inv


if os.environ.get("TRITON_INTERPRET") == "1" and __name__ == "__main__":
    import triton
    import triton.language as tl  # noqa: F401  (the interpreter wants it visible to the jit'd function)

    from hpc_kernels import kv_quant_triton as _kt

    _QUOTIENT = _kt._quotient
    _uncorrected_quotient = triton.jit(_uncorrected_quotient)


# -- the tests (parent process) --------------------------------------------------------------

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture(scope="module")
def report():
    path = os.pathsep.join([str(HERE)] + [p for p in sys.path if p])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("label", [f[0] for f in _formats()])
def test_interpreted_kernels_match_reference(report, label):
    cases = report["cases"][label]
    assert cases, f"no cases ran for {label}"
    bad = [c for c in cases if c["mismatches"] or not c["count_ok"] or not all(c.get("gather_equal", {}).values())]
    assert not bad, f"{label}: {bad}"
    assert any(not c["fast_div"] for c in cases), f"{label}: the exact-division path did not run"
    assert any(c["fast_div"] for c in cases), f"{label}: the fast path did not run"


def test_tie_data_needs_the_quotient_corrections(report):
    """Without the two remainder corrections (the quotient as x * fl(1 / s)) the exact and
    near ties give wrong codes: the tie data tests what the corrections are for."""
    assert report["uncorrected"], "no case ran"
    for label, (ties, near_ties) in report["uncorrected"].items():
        assert ties > 0 and near_ties > 0, f"{label}: tie data matched without the corrections"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    print(json.dumps(_child()))
