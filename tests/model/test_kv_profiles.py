"""Every KV profile through the model: first-token logits near bf16, greedy top-1 agreement.

The reference is the bf16 profile on the same fp32 builtin:random model. Agreement is measured
teacher-forced: each profile decodes bf16's greedy continuation (64 tokens) and we count the
positions where its own top-1 is the same token. The bounds are the measured figures with a
margin (see BOUNDS); a profile whose quantize is not implemented yet is skipped.
"""

from __future__ import annotations

import pytest
import torch

from hpc_cli.model import HybridModel
from hpc_cli.plugins import kv_profile

from .helpers import rel_err

STEPS = 64
# profile: (max relative error of the first-token logits vs bf16, min top-1 agreement of 64)
BOUNDS = {
    "bf16": (0.0, 64),
    "int8-g64": (0.02, 60),
    "fp8-e4m3fn-row256": (0.05, 56),
    "nvfp4-g16": (0.15, 48),
    "k8v4": (0.15, 48),
}


@pytest.fixture(scope="module")
def tiny():
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt(tiny):
    tok = tiny.tokenizer
    text = tok.apply_chat_template([
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Explain why the hybrid prefix cache keeps recurrent snapshots "
                                    "next to the 64-token KV blocks, in two sentences."}])
    return torch.tensor(tok.encode(text))


def _run(model, profile, prompt, forced=None):
    n = prompt.shape[0] + STEPS + 1
    pages = (n + 63) // 64
    kv = model.new_kv_storage(profile, pages)
    states = model.new_state_slots(1)
    table = list(range(pages))
    first = model.prefill(prompt, 0, table, 0, kv, states).logits
    tops, tok, pos = [], int(first.argmax()), prompt.shape[0]
    tops.append(tok)
    for i in range(STEPS - 1):
        feed = tok if forced is None else forced[i]
        logits = model.decode([feed], [pos], [table], [0], kv, states)[0]
        tok = int(logits.argmax())
        tops.append(tok)
        pos += 1
    return first, tops


@pytest.fixture(scope="module")
def reference(tiny, prompt):
    return _run(tiny, kv_profile("bf16"), prompt)


@pytest.mark.parametrize("name", list(BOUNDS))
def test_profile_fidelity(tiny, prompt, reference, name):
    profile = kv_profile(name)
    try:
        profile.quantize(torch.zeros(1, 1, tiny.config.head_dim), "k",
                         torch.tensor(1.0) if profile.uses_global_scale else None)
    except NotImplementedError:
        pytest.skip(f"KV profile {name} has no quantize yet")
    ref_first, ref_tokens = reference
    first, tops = _run(tiny, profile, prompt, forced=ref_tokens)
    err = rel_err(first, ref_first)
    agree = sum(a == b for a, b in zip(tops, ref_tokens))
    print(f"\n{name}: first-token rel err {err:.4f}, top-1 agreement {agree}/{STEPS}")
    max_err, min_agree = BOUNDS[name]
    assert err <= max_err, f"{name}: first-token logits differ from bf16 by {err:.4f} (bound {max_err})"
    assert agree >= min_agree, f"{name}: top-1 agreed on {agree}/{STEPS} tokens (bound {min_agree})"
