"""Qwen3.5-MoE's sparse block: softmax router, top-k renormalised, fused experts, gated shared expert.

Experts are kept fused as in transformers: ``experts.gate_up_proj`` ``[E, 2*I, hidden]`` and
``experts.down_proj`` ``[E, hidden, I]`` (the loader fuses per-expert checkpoint tensors).

With ``host=True`` (``HybridModel(..., offload_experts=True)``) the two are created in host memory,
pinned when asked, as views of one packed ``[E, blob]`` byte array (each expert's gate_up then
down bytes): the layout the expert tier fills its device slots from, so
:class:`hpc_cli.experts.tier.ExpertTier` adopts that array instead of copying the experts, and
the routed experts are never materialised on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpc_cli.model.layers import MLP, Linear, param


def packed_host_experts(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                        pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's experts in host memory: ``packed`` ``[E, blob]`` uint8 (``blob`` = the gate_up
    bytes then the down bytes of one expert) and the typed views ``gate_up`` ``[E, 2*I, hidden]``
    and ``down`` ``[E, hidden, I]`` of it. Uninitialised; pinned when ``pin``."""
    elem = torch.empty(0, dtype=dtype).element_size()
    gu_bytes = 2 * intermediate * hidden * elem
    blob = gu_bytes + hidden * intermediate * elem
    packed = torch.empty(num_experts, blob, dtype=torch.uint8, pin_memory=pin)
    gate_up = packed[:, :gu_bytes].view(dtype).view(num_experts, 2 * intermediate, hidden)
    down = packed[:, gu_bytes:].view(dtype).view(num_experts, hidden, intermediate)
    return packed, gate_up, down


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, device=None, dtype=None,
                 host: bool = False, pin: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        #: with ``host``: the packed host array the parameters are views of (the tier takes it)
        self.host_packed: torch.Tensor | None = None
        if host:
            dtype = dtype if dtype is not None else torch.get_default_dtype()
            packed, gate_up, down = packed_host_experts(num_experts, hidden, intermediate, dtype, pin)
            self.host_packed = packed
            self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
            self.down_proj = nn.Parameter(down, requires_grad=False)
        else:
            self.gate_up_proj = param(num_experts, 2 * intermediate, hidden, device=device, dtype=dtype)
            self.down_proj = param(num_experts, hidden, intermediate, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, hidden]``, ``index``/``weights`` ``[N, top_k]``."""
        if self.gate_up_proj.device != x.device:  # host experts without a tier: compute on the host
            wd = self.gate_up_proj.device
            return self.forward(x.to(wd), index.to(wd), weights.to(wd)).to(x.device)
        out = torch.zeros_like(x)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // index.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            tok = token_of[start:start + c]
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * w_sorted[start:start + c, None]
            out.index_add_(0, tok, y.to(out.dtype))
            start += c
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg, device=None, dtype=None, host_experts: bool = False, pin: bool = False) -> None:
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Module()
        self.gate.weight = param(cfg.num_experts, cfg.hidden_size, **fk)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, **fk,
                               host=host_experts, pin=pin)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, **fk)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, **fk)
        # hpc_cli.experts.hook.hook_model sets these: the routed experts then run split
        # between device slots and the host copy (router and shared expert stay here)
        self.expert_tier = None
        self.layer_index = -1

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        shared = self.shared_expert(x)
        weights, index = self.route(x)
        if self.expert_tier is not None:
            routed = self.expert_tier.routed(self.layer_index, x, index, weights, self.experts)
        else:
            routed = self.experts(x, index, weights)
        out = routed + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out.view(shape)
