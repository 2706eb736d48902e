"""Check that the training forwards of the MTP head and the block drafters match the runtime's
drafting code: ``python scripts/_check_drafters.py hpc_cli/model/tiny``."""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny as tt  # noqa: E402
from hpc_cli.memory.kv_pool import PagedKVStorage  # noqa: E402
from hpc_cli.plugins import kv_profile  # noqa: E402
from hpc_cli.speculative.dflash import DFlashDrafter, load_drafter  # noqa: E402
from hpc_cli.model.loader import load_checkpoint  # noqa: E402


@torch.no_grad()
def block_against_runtime(m, net, toks: torch.Tensor, p: int, k: int) -> tuple[float, float]:
    """The block drafter ``net``'s training forward (``train_tiny.drafter_forward``) against the
    runtime's proposal for a lane at position ``p`` of ``toks`` ``[1, T]``: (the largest difference
    of the ``k`` drafting columns' final hidden, the largest value of the training one)."""
    cap = tuple(net.cfg.target_layers)
    h, feats = tt.forward(m, toks, cap)
    rot = tt.Rotary(net.cfg.head_dim, net.cfg.rope_theta)
    hid_t = tt.drafter_forward(net, m, rot, feats, toks, torch.tensor([[p]]), k, h)[0, 0]
    dr = DFlashDrafter(m, net)
    states = m.new_state_slots(1, extra_parts=dr.state_parts() or None)  # the geometry the engine gives it
    spec = dr.pool_spec()
    pool = (PagedKVStorage(kv_profile("bf16"), spec.layers, spec.kv_heads, spec.head_dim, 4, device="cpu", name="b")
            if spec is not None else None)
    dr.bind(None, pool, states)
    lane = SimpleNamespace(pos=0, state_slot=0, pages=[0, 1, 2, 3], next_token=int(toks[0, p]), backend_frontier=0)
    dr.observe(lane, 0, p, None, feats[0, :p], None, extend=False)
    lane.pos = p
    states.hidden[0].copy_(h[0, p - 1])  # the hidden before the block (an anchor-drafting block reads it)
    seen = []
    orig = m.lm_head.forward
    m.lm_head.forward = lambda x: (seen.append(x.clone()), orig(x))[1]
    try:
        dr.propose([lane], k, states)
    finally:
        m.lm_head.forward = orig
    hid_r = seen[0][0]
    return (hid_r - hid_t).abs().max().item(), hid_t.abs().max().item()


@torch.no_grad()
def main(d):
    m = load_checkpoint(d, dtype=torch.float32, device="cpu", progress=False)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 6000, (1, 150), generator=g)
    for kind in ("dflash", "dflash2"):
        net = load_drafter(str(Path(d) / kind), kind, "cpu", torch.float32)
        diff, scale = block_against_runtime(m, net, toks, 100, 3)
        print(kind, "max diff", diff, "scale", scale)

    # MTP: the runtime's step 1 at position p-1 against the training forward
    from hpc_cli.speculative.mtp import MTPDrafter

    h, _ = tt.forward(m, toks)
    g1 = tt.mtp_forward(m, toks[:, 1:], h[:, :-1], 0)[0]
    storage = PagedKVStorage(kv_profile("bf16"), len(m.config.attention_layers) + 1, m.config.num_key_value_heads,
                             m.config.head_dim, 4, device="cpu")
    states = m.new_state_slots(1)
    dr = MTPDrafter(m)
    dr.bind(storage, None, states)
    p = 100
    lane = SimpleNamespace(pos=p, state_slot=0, pages=[0, 1, 2, 3], next_token=int(toks[0, p]), backend_frontier=None,
                           tokens=toks[0, :p + 1].tolist())
    dr.observe(lane, 0, p, h[0, :p], None, None, extend=True)
    states.hidden[0].copy_(h[0, p - 1])
    seen = []
    orig = m.lm_head.forward
    m.lm_head.forward = lambda x: (seen.append(x.clone()), orig(x))[1]
    dr.propose([lane], 1, states)
    m.lm_head.forward = orig
    print("mtp max diff", (seen[0].reshape(-1) - g1[p - 1]).abs().max().item(), "scale", g1[p - 1].abs().max().item())


if __name__ == "__main__":
    main(sys.argv[1])
