"""The split MoE computation: every routed pick whose expert is resident is computed on the device
from its slot, the misses on the host from the host copy, and the two are added. A layer whose
experts are all resident never reads from the device: the picks' slots come from the device
residency tensor and their weights are gathered from the slot arena into batched matmuls.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hpc_cli.experts.cache import NOT_RESIDENT, ExpertCache, ExpertCacheError
from hpc_cli.experts.host import HostLayer
from hpc_cli.experts.trace import Recorder


class ExpertSplit:
    """The routed computation of :class:`~hpc_cli.experts.tier.ExpertTier` (which sets every
    attribute below) and the residency it computes with.

    ``residency`` (device) and ``_live`` (its host mirror, ``_live_count`` per layer) map
    ``(layer, expert)`` to a slot or NOT_RESIDENT. A pair enters both once its slot holds the
    expert (a blocking fill, or an asynchronous fill whose event completed: ``_pending``); the
    device entry is written on the compute stream, so every kernel queued after it sees the
    filled slot, and the two never disagree for a kernel the host reasons about.
    """

    device: torch.device
    layers: list[int]
    n_expert: int
    admission: str
    offload: bool
    cache: ExpertCache | None
    host: dict[int, HostLayer]
    recorder: Recorder | None
    residency: torch.Tensor | None
    hits: np.ndarray
    misses: np.ndarray
    host_bytes: int
    tokens: int
    calls: int
    syncs: int
    miss_calls: int
    gather_max_picks: int
    gather_max_bytes: int
    _live: np.ndarray
    _live_count: np.ndarray
    _pending: dict[int, tuple[Any, int, int]]
    _views: dict[int, tuple[torch.Tensor, torch.Tensor]]
    _layer_rows: dict[int, tuple[torch.Tensor, int] | None]
    _stream: Any

    def _publish(self, layer: int, expert: int, slot: int) -> None:
        """``(layer, expert)``'s slot holds the expert now: the split may compute from it."""
        if self._live[layer, expert] == NOT_RESIDENT:
            self._live_count[layer] += 1
        self._live[layer, expert] = slot
        self.residency[layer, expert] = slot  # a fill kernel on the current stream, no wait

    def _poll(self, wait: bool = False) -> None:
        """Publish the asynchronous fills that have finished (``ev.query()`` does not wait)."""
        for slot, (ev, layer, expert) in list(self._pending.items()):
            if wait or ev is None or ev.query():
                del self._pending[slot]
                self._publish(layer, expert, slot)

    def _slot_views(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = self._views.get(slot)
        if v is None:
            h = self.host[layer]
            raw = self.cache.device_slot(slot)
            gu = raw[:h.gu_bytes].view(h.dtype).view(*h.shape_gu)
            dn = raw[h.gu_bytes:h.blob].view(h.dtype).view(*h.shape_dn)
            v = self._views[slot] = (gu, dn)
        return v

    def _rows(self, layer: int) -> tuple[torch.Tensor, int] | None:
        """The slots ``layer`` can occupy as one typed ``[n, stride]`` view of the arena (each row a
        slot: the gate_up then the down elements, then padding), and the first of those slots.
        Uniform slots: the whole arena. Per-layer sized slots: the layer's own range, whose slots
        all have the layer's size. None when the layer has no slot."""
        if layer in self._layer_rows:
            return self._layer_rows[layer]
        c, h = self.cache, self.host[layer]
        lo, hi = (0, c.slots) if c.uniform else c.layer_slot_range(layer)
        rows = None
        if hi > lo:
            strides = np.diff(c.off[lo:hi + 1])
            stride = int(strides[0])
            elem = torch.empty(0, dtype=h.dtype).element_size()
            if (strides != stride).any() or stride % elem or int(c.off[lo]) % elem or c.slot_bytes[lo] < h.blob:
                raise ExpertCacheError(f"layer {layer}'s slots {lo}..{hi - 1} are not of one size that holds "
                                       f"its {h.blob}-byte experts")
            typed = c.base.view(h.dtype)
            rows = (typed.as_strided((hi - lo, stride // elem), (stride // elem, 1), int(c.off[lo]) // elem), lo)
        self._layer_rows[layer] = rows
        return rows

    def _gather(self, layer: int, x: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed sum for ``x`` ``[N, hidden]`` from the slots ``slot`` ``[N, top_k]`` (each a
        valid slot of the layer), weighted by ``weights``: the slots' weights gathered by index
        and two batched matmuls, all on the device, no host read, no loop over experts."""
        rows, lo = self._rows(layer)
        n, k = slot.shape
        chunk = max(1, self.gather_max_bytes // (k * rows.shape[1] * rows.element_size()))
        if n > chunk:  # bound the copies: a few token chunks (not a loop over experts)
            return torch.cat([self._gather(layer, x[i:i + chunk], slot[i:i + chunk], weights[i:i + chunk])
                              for i in range(0, n, chunk)])
        h = self.host[layer]
        local = slot.reshape(-1)
        if lo:
            local = local - lo
        blobs = rows.index_select(0, local)  # [N*k, stride]: each pick's expert, one copy
        gu_n, dn_n = h.shape_gu[0] * h.shape_gu[1], h.shape_dn[0] * h.shape_dn[1]
        gu = blobs[:, :gu_n].view(n * k, *h.shape_gu)  # [P, 2I, hidden]
        dn = blobs[:, gu_n:gu_n + dn_n].view(n * k, *h.shape_dn)  # [P, hidden, I]
        xr = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1], 1)
        gate, up = torch.bmm(gu, xr).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(dn, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [P, hidden]
        y = y * weights.reshape(-1, 1)
        return y.view(n, k, -1).sum(dim=1).to(x.dtype)

    def _read(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """``tensors`` on the host after one wait for the device (counted in ``syncs``)."""
        self.syncs += 1
        if self.device.type != "cuda":
            return list(tensors)
        out = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def routed(self, layer: int, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
               experts: Any) -> torch.Tensor:
        """The routed experts' sum for ``x`` ``[N, hidden]`` (``index``/``weights`` ``[N, top_k]``).

        Every pick whose expert is resident is computed on the device from its slot; with all of
        the layer's experts resident (known on the host) that is all the layer does: no read from
        the device, routing never leaves it. Otherwise the device marks the picks that miss, one
        read brings those marks (and ``x``, ``weights``) to the host, the hits are queued on the
        device and the misses computed from the host copy meanwhile, and the two are added."""
        if self.recorder is not None:
            self.recorder.add(layer, index.cpu().numpy().astype(np.int16))
        n, k = index.shape
        if layer == self.layers[0]:
            self.tokens += n
            self.calls += 1
        if not self.offload:
            return experts(x, index, weights)
        if n == 0:
            return torch.zeros_like(x)
        if self._pending:
            self._poll()
        live = int(self._live_count[layer])
        if n * k > self.gather_max_picks:
            return self._routed_loop(layer, x, index, weights, live)
        if live == self.n_expert:  # every pick a hit: no read, stats from the shapes
            self.hits[layer] += n * k
            return self._gather(layer, x, self.residency[layer][index], weights)
        slot = self.residency[layer][index]  # [N, k] int32, NOT_RESIDENT for a miss
        hit = slot >= 0
        code = torch.where(hit, slot.to(index.dtype), -1 - index)  # a slot, or -1 - the missed expert
        code_h, xh, wh = self._read(code, x, weights)
        code_h = code_h.numpy()
        n_hit = int((code_h >= 0).sum())
        self.hits[layer] += n_hit
        self.misses[layer] += n * k - n_hit
        out = None
        if n_hit:  # queued before the host work, so the device computes the hits meanwhile
            safe = torch.where(hit, slot, self._rows(layer)[1])
            out = self._gather(layer, x, safe, torch.where(hit, weights, torch.zeros_like(weights)))
        if n_hit == n * k:
            return out
        acc = self._host_misses(layer, code_h, xh, wh, k)
        acc = acc.to(x.device, x.dtype)
        return acc if out is None else out + acc

    def _routed_loop(self, layer: int, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     live: int) -> torch.Tensor:
        """A large batch (prefill): one read of every pick's slot, then one device computation per
        resident expert routed (as the plain MoE loops over its experts) and the misses on the host."""
        slot = self.residency[layer][index]
        code = torch.where(slot >= 0, slot.to(index.dtype), -1 - index)
        if live == self.n_expert:
            (code_h,), xh, wh = self._read(code), None, None
        else:
            code_h, xh, wh = self._read(code, x, weights)
        code_h = code_h.numpy()
        n, k = code_h.shape
        flat = code_h.reshape(-1)
        order = np.argsort(flat, kind="stable")
        sorted_code = flat[order]
        first_hit = int(np.searchsorted(sorted_code, 0))  # misses (negative codes) sort first
        n_hit = flat.size - first_hit
        self.hits[layer] += n_hit
        self.misses[layer] += flat.size - n_hit
        out = torch.zeros_like(x)
        if n_hit:
            hit_order = order[first_hit:]
            dev_order = torch.from_numpy(hit_order).to(x.device, non_blocking=True)
            dev_tok = dev_order // k
            w_sorted = weights.reshape(-1)[dev_order]
            slots, starts, counts = np.unique(sorted_code[first_hit:], return_index=True, return_counts=True)
            for s, start, c in zip(slots.tolist(), starts.tolist(), counts.tolist()):
                gu, dn = self._slot_views(s, layer)
                tok = dev_tok[start:start + c]
                gate, up = F.linear(x[tok], gu).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, dn) * w_sorted[start:start + c, None]
                out.index_add_(0, tok, y.to(out.dtype))
        if n_hit < flat.size:
            out = out + self._host_misses(layer, code_h, xh, wh, k).to(x.device, x.dtype)
        return out

    def _host_misses(self, layer: int, code: np.ndarray, xh: torch.Tensor, wh: torch.Tensor,
                     k: int) -> torch.Tensor:
        """The missed picks (negative ``code``: ``-1 - expert``) computed from the host copy, each
        missed expert read once for all its tokens; counts the bytes, admits under first-routed."""
        host = self.host[layer]
        flat = code.reshape(-1)
        pos = np.flatnonzero(flat < 0)
        miss_expert = -1 - flat[pos]
        order = np.argsort(miss_expert, kind="stable")
        pos, miss_expert = pos[order], miss_expert[order]
        experts, starts, counts = np.unique(miss_expert, return_index=True, return_counts=True)
        xh = xh.to("cpu", host.dtype)
        w = wh.reshape(-1).to("cpu")[torch.from_numpy(pos)]
        tok_all = torch.from_numpy(pos // k)
        acc = torch.zeros(xh.shape, dtype=host.dtype)
        for e, start, c in zip(experts.tolist(), starts.tolist(), counts.tolist()):
            tok = tok_all[start:start + c]
            gate, up = F.linear(xh[tok], host.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, host.down[e]) * w[start:start + c, None]
            acc.index_add_(0, tok, y.to(acc.dtype))
        self.miss_calls += 1
        self.host_bytes += len(experts) * host.blob
        if self.admission != "profile":
            self._admit_misses(layer, experts.tolist())
        return acc

    def _admit_misses(self, layer: int, experts: list[int]) -> None:
        host = self.host[layer]
        for e in experts:
            if int(self.cache.table[layer, e]) != NOT_RESIDENT:
                continue
            slot = self.cache.admit(layer, e, host.blob)
            if slot == NOT_RESIDENT:
                if not self.cache.per_layer:
                    return
                break
            ev = self.cache.fill_slot(slot, host.packed[e], self._stream, host.blob)
            if ev is None:  # the copy is done (CPU)
                self._publish(layer, e, slot)
            else:  # published by _poll once the event has completed
                self._pending[slot] = (ev, layer, e)
