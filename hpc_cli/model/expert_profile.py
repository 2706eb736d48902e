"""Expert residency profiles (``STRP``) and routing traces (``HPCT``): write, read, rank, score.

A *routing trace* records, for every token the model ran, the ``top_k`` experts each MoE layer
routed it to. A *profile* ranks the ``(layer, expert)`` pairs of one or more traces by routing
frequency; the expert tier admits the top ``slots`` of them into VRAM. ``score`` says what a
profile will hit on another trace, in-sample and ten-fold held out (docs/expert-profile.md).

Both formats are little-endian::

    STRP  magic b"STRP", u32 version (1), u32 n_layers, u32 n_expert, u32 slots, u32 n_ranked,
          n_ranked x (i32 layer, i32 expert)   ranked by descending routing frequency,
          n_layers x n_expert u64              the frequency table (row-major by layer)
    HPCT  magic b"HPCT", u32 version (1), u32 n_layers, u32 n_expert, u32 top_k,
          then records until the end: n_layers x top_k i16 expert ids per token
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

import numpy as np

from hpc_cli.errors import CacheFileError

PROFILE_MAGIC = b"STRP"
PROFILE_VERSION = 1
TRACE_MAGIC = b"HPCT"
TRACE_VERSION = 1
_PROFILE_HEAD = struct.Struct("<4s5I")
_TRACE_HEAD = struct.Struct("<4s4I")
_HINT_PROFILE = "rebuild it with `hpc-cli expert profile TRACES --slots N -o FILE`"


# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------

@dataclass
class ExpertProfile:
    n_layers: int
    n_expert: int
    slots: int
    ranked: np.ndarray  # [n_ranked, 2] int32 (layer, expert), by descending frequency
    freq: np.ndarray  # [n_layers, n_expert] uint64

    @property
    def n_ranked(self) -> int:
        return int(self.ranked.shape[0])

    def top(self, slots: int | None = None) -> np.ndarray:
        """The pairs a tier of ``slots`` (default the profile's own) would hold: ``[S, 2]``."""
        s = self.slots if slots is None else slots
        return self.ranked[:max(0, s)]

    def resident_mask(self, slots: int | None = None) -> np.ndarray:
        """``[n_layers, n_expert]`` bool: resident under the top ``slots`` pairs."""
        mask = np.zeros((self.n_layers, self.n_expert), dtype=bool)
        top = self.top(slots)
        mask[top[:, 0], top[:, 1]] = True
        return mask


def rank_pairs(freq: np.ndarray) -> np.ndarray:
    """Every pair with a non-zero count, by descending count (ties: layer, then expert)."""
    flat = freq.reshape(-1).astype(np.int64)
    order = np.lexsort((np.arange(flat.size), -flat))  # last key primary: count desc, then index
    order = order[flat[order] > 0]
    n_expert = freq.shape[1]
    return np.stack([order // n_expert, order % n_expert], axis=1).astype(np.int32)


def build_profile(freq: np.ndarray, slots: int) -> ExpertProfile:
    freq = np.asarray(freq, dtype=np.uint64)
    if slots < 0:
        raise CacheFileError(f"slots must be >= 0, got {slots}", hint="pass --slots N with N >= 0")
    return ExpertProfile(freq.shape[0], freq.shape[1], int(slots), rank_pairs(freq), freq)


def write_profile(path: str | os.PathLike, profile: ExpertProfile) -> None:
    ranked = np.ascontiguousarray(profile.ranked, dtype="<i4")
    freq = np.ascontiguousarray(profile.freq, dtype="<u8")
    assert freq.shape == (profile.n_layers, profile.n_expert), "frequency table shape"
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_PROFILE_HEAD.pack(PROFILE_MAGIC, PROFILE_VERSION, profile.n_layers, profile.n_expert,
                                   profile.slots, ranked.shape[0]))
        f.write(ranked.tobytes())
        f.write(freq.tobytes())
    os.replace(tmp, path)


def is_profile_file(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == PROFILE_MAGIC
    except OSError:
        return False


def read_profile(path: str | os.PathLike, n_layers: int | None = None,
                 n_expert: int | None = None) -> ExpertProfile:
    """Read and check a profile; ``n_layers``/``n_expert`` (when given) must match the model."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CacheFileError(f"expert profile {path} cannot be read: {exc.strerror}", hint="check the path") from None
    where = f"expert profile {path}"
    if len(data) < 4 or data[:4] != PROFILE_MAGIC:
        raise CacheFileError(f"{where} is not an expert profile (magic {data[:4]!r}, expected b'STRP')",
                             hint=_HINT_PROFILE)
    if len(data) < _PROFILE_HEAD.size:
        raise CacheFileError(f"{where} is truncated: {len(data)} bytes, the header alone is {_PROFILE_HEAD.size}",
                             hint=_HINT_PROFILE)
    _, version, layers, experts, slots, n_ranked = _PROFILE_HEAD.unpack_from(data)
    if version != PROFILE_VERSION:
        raise CacheFileError(f"{where} has version {version}; this build reads version {PROFILE_VERSION}",
                             hint=_HINT_PROFILE)
    if layers == 0 or experts == 0:
        raise CacheFileError(f"{where} has an empty shape ({layers} layers x {experts} experts)", hint=_HINT_PROFILE)
    if (n_layers is not None and layers != n_layers) or (n_expert is not None and experts != n_expert):
        raise CacheFileError(f"{where} is for {layers} layers x {experts} experts; the model has "
                             f"{n_layers} x {n_expert}", hint="build a profile from this model's routing traces")
    if n_ranked > layers * experts:
        raise CacheFileError(f"{where} ranks {n_ranked} pairs but the shape has only {layers * experts}",
                             hint=_HINT_PROFILE)
    need = _PROFILE_HEAD.size + 8 * n_ranked + 8 * layers * experts
    if len(data) < need:
        raise CacheFileError(f"{where} is truncated: {len(data)} bytes of {need}", hint=_HINT_PROFILE)
    if len(data) > need:
        raise CacheFileError(f"{where} has {len(data) - need} bytes past its end ({need})", hint=_HINT_PROFILE)
    off = _PROFILE_HEAD.size
    ranked = np.frombuffer(data, dtype="<i4", count=2 * n_ranked, offset=off).reshape(n_ranked, 2).astype(np.int32)
    freq = np.frombuffer(data, dtype="<u8", count=layers * experts, offset=off + 8 * n_ranked)
    freq = freq.reshape(layers, experts).astype(np.uint64)
    if n_ranked:
        bad = (ranked[:, 0] < 0) | (ranked[:, 0] >= layers) | (ranked[:, 1] < 0) | (ranked[:, 1] >= experts)
        if bad.any():
            i = int(np.argmax(bad))
            raise CacheFileError(f"{where}: ranked pair {i} ({ranked[i, 0]}, {ranked[i, 1]}) is outside "
                                 f"{layers} layers x {experts} experts", hint=_HINT_PROFILE)
        flat = ranked[:, 0].astype(np.int64) * experts + ranked[:, 1]
        if np.unique(flat).size != flat.size:
            raise CacheFileError(f"{where}: the ranking lists a (layer, expert) pair twice", hint=_HINT_PROFILE)
    return ExpertProfile(layers, experts, slots, ranked, freq)


def summarize_profile(profile: ExpertProfile, top: int = 10) -> dict:
    """What ``hpc-cli cache inspect`` shows for a profile: header, per-layer residency, top experts."""
    mask = profile.resident_mask()
    total = int(profile.freq.sum())
    covered = int(profile.freq[mask].sum())
    per_layer = []
    for layer in range(profile.n_layers):
        row = profile.freq[layer]
        lt = int(row.sum())
        per_layer.append({"layer": layer, "resident": int(mask[layer].sum()), "routed": lt,
                          "h_expert_in_sample": (int(row[mask[layer]].sum()) / lt) if lt else 0.0})
    tops = [{"rank": i, "layer": int(l), "expert": int(e), "count": int(profile.freq[l, e]),
             "share": (int(profile.freq[l, e]) / total) if total else 0.0}
            for i, (l, e) in enumerate(profile.ranked[:top])]
    return {"format": "STRP", "version": PROFILE_VERSION, "n_layers": profile.n_layers,
            "n_expert": profile.n_expert, "slots": profile.slots, "n_ranked": profile.n_ranked,
            "resident": int(mask.sum()), "routed_total": total,
            "h_expert_in_sample": covered / total if total else 0.0,
            "per_layer": per_layer, "top": tops}


# ---------------------------------------------------------------------------------------------
# Routing traces
# ---------------------------------------------------------------------------------------------

class TraceWriter:
    """Appends routing records to an ``HPCT`` file (header written on open; no footer)."""

    def __init__(self, path: str | os.PathLike, n_layers: int, n_expert: int, top_k: int) -> None:
        if n_expert > 32767:
            raise CacheFileError(f"routing traces hold expert ids as i16; {n_expert} experts do not fit",
                                 hint="this model is outside the trace format")
        self.path = Path(path)
        self.n_layers, self.n_expert, self.top_k = n_layers, n_expert, top_k
        self.tokens = 0
        self._f: BinaryIO | None = open(self.path, "wb")
        self._f.write(_TRACE_HEAD.pack(TRACE_MAGIC, TRACE_VERSION, n_layers, n_expert, top_k))

    def write(self, records: np.ndarray) -> None:
        """``records`` ``[N, n_layers, top_k]`` expert ids."""
        assert self._f is not None, "trace writer is closed"
        records = np.asarray(records)
        assert records.shape[1:] == (self.n_layers, self.top_k), \
            f"trace records {records.shape[1:]} != ({self.n_layers}, {self.top_k})"
        self._f.write(np.ascontiguousarray(records, dtype="<i2").tobytes())
        self.tokens += records.shape[0]

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class RoutingTrace:
    n_layers: int
    n_expert: int
    top_k: int
    records: np.ndarray  # [tokens, n_layers, top_k] int16

    @property
    def tokens(self) -> int:
        return int(self.records.shape[0])

    def counts(self) -> np.ndarray:
        """``[n_layers, n_expert]`` routing counts."""
        return trace_counts(self.records, self.n_expert)


def trace_counts(records: np.ndarray, n_expert: int) -> np.ndarray:
    t, n_layers, k = records.shape
    flat = (np.arange(n_layers, dtype=np.int64)[None, :, None] * n_expert + records.astype(np.int64)).reshape(-1)
    return np.bincount(flat, minlength=n_layers * n_expert).reshape(n_layers, n_expert).astype(np.uint64)


def read_trace(path: str | os.PathLike) -> RoutingTrace:
    where = f"routing trace {path}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CacheFileError(f"{where} cannot be read: {exc.strerror}", hint="check the path") from None
    if data[:4] != TRACE_MAGIC:
        raise CacheFileError(f"{where} is not a routing trace (magic {data[:4]!r}, expected b'HPCT')",
                             hint="record one with `hpc-cli expert record` or [experts] trace_file")
    if len(data) < _TRACE_HEAD.size:
        raise CacheFileError(f"{where} is truncated inside its header", hint="record it again")
    _, version, n_layers, n_expert, top_k = _TRACE_HEAD.unpack_from(data)
    if version != TRACE_VERSION:
        raise CacheFileError(f"{where} has version {version}; this build reads version {TRACE_VERSION}",
                             hint="record it again with this build")
    rec = 2 * n_layers * top_k
    body = len(data) - _TRACE_HEAD.size
    if rec == 0:
        raise CacheFileError(f"{where} has an empty record shape", hint="record it again")
    tokens = body // rec  # a trace cut mid-record (a killed server) keeps its whole records
    records = np.frombuffer(data, dtype="<i2", count=tokens * n_layers * top_k, offset=_TRACE_HEAD.size)
    records = records.reshape(tokens, n_layers, top_k).astype(np.int16)
    if tokens and (records.min() < 0 or records.max() >= n_expert):
        raise CacheFileError(f"{where} holds expert ids outside [0, {n_expert})", hint="record it again")
    return RoutingTrace(n_layers, n_expert, top_k, records)


def read_traces(paths: Sequence[str | os.PathLike]) -> RoutingTrace:
    """Several traces of one model, concatenated in the order given."""
    if not paths:
        raise CacheFileError("no routing traces given", hint="pass one or more trace files")
    traces = [read_trace(p) for p in paths]
    first = traces[0]
    for p, t in zip(paths[1:], traces[1:]):
        if (t.n_layers, t.n_expert, t.top_k) != (first.n_layers, first.n_expert, first.top_k):
            raise CacheFileError(f"routing trace {p} is {t.n_layers} layers x {t.n_expert} experts, top {t.top_k}; "
                                 f"{paths[0]} is {first.n_layers} x {first.n_expert}, top {first.top_k}",
                                 hint="score traces of one model together")
    return RoutingTrace(first.n_layers, first.n_expert, first.top_k,
                        np.concatenate([t.records for t in traces], axis=0))


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------

def hit_rates(records: np.ndarray, mask: np.ndarray) -> tuple[float, float, np.ndarray]:
    """``h_expert`` (routed picks resident), ``h_layer`` ((token, layer) pairs with every pick
    resident) and ``h_expert`` per layer, of ``records`` ``[T, L, k]`` under ``mask`` ``[L, E]``."""
    if records.shape[0] == 0:
        return 0.0, 0.0, np.zeros(mask.shape[0])
    layers = np.arange(records.shape[1])[None, :, None]
    hit = mask[layers, records.astype(np.int64)]  # [T, L, k]
    return float(hit.mean()), float(hit.all(axis=2).mean()), hit.mean(axis=(0, 2))


def simulate_first_routed(records: np.ndarray, n_expert: int, slots: int, per_layer: bool) -> float:
    """``h_expert`` of the admission-on-first-route policies (no eviction): the first ``slots``
    distinct pairs (per layer: each layer's first ``q`` with the remainder to the last) are
    admitted when first routed; that first pick is a miss (the fill is in flight)."""
    t, n_layers, k = records.shape
    if t == 0:
        return 0.0
    flat = (np.arange(n_layers)[None, :, None] * n_expert + records.astype(np.int64)).reshape(-1)
    pairs, first = np.unique(flat, return_index=True)
    order = np.argsort(first, kind="stable")
    pairs, first = pairs[order], first[order]
    if per_layer:
        q = slots // n_layers
        lim = np.full(n_layers, q)
        lim[-1] += slots - q * n_layers
        layer_of = pairs // n_expert
        rank_in_layer = np.zeros_like(layer_of)
        for layer in range(n_layers):
            sel = layer_of == layer
            rank_in_layer[sel] = np.arange(int(sel.sum()))
        admitted = rank_in_layer < lim[layer_of]
    else:
        admitted = np.arange(pairs.size) < slots
    admit_at = np.full(n_layers * n_expert, np.iinfo(np.int64).max, dtype=np.int64)
    # a pick hits from the next token on (picks of one token share its admission)
    admit_at[pairs[admitted]] = first[admitted] // (n_layers * k)
    token = np.arange(flat.size) // (n_layers * k)
    return float((admit_at[flat] < token).mean())


def kfold(records: np.ndarray, n_expert: int, slots: int, folds: int = 10) -> dict:
    """Leave-one-fold-out: rank on ``folds - 1`` contiguous folds, score the one held out."""
    t = records.shape[0]
    if t < folds:
        raise CacheFileError(f"{t} traced tokens cannot be split into {folds} folds",
                             hint="record a longer trace or pass fewer --folds")
    edges = np.linspace(0, t, folds + 1).astype(int)
    total = trace_counts(records, n_expert).astype(np.int64)
    he, hl = [], []
    for i in range(folds):
        held = records[edges[i]:edges[i + 1]]
        train = total - trace_counts(held, n_expert).astype(np.int64)
        prof = build_profile(train.astype(np.uint64), slots)
        e, l, _ = hit_rates(held, prof.resident_mask())
        he.append(e)
        hl.append(l)
    he_a, hl_a = np.array(he), np.array(hl)
    return {"folds": folds, "h_expert": float(he_a.mean()), "h_expert_min": float(he_a.min()),
            "h_expert_max": float(he_a.max()), "h_expert_std": float(he_a.std(ddof=1)) if folds > 1 else 0.0,
            "h_layer": float(hl_a.mean()), "h_layer_min": float(hl_a.min()), "h_layer_max": float(hl_a.max()),
            "per_fold_h_expert": [float(x) for x in he_a]}


def score(profile: ExpertProfile, trace: RoutingTrace, slots: int | None = None, folds: int = 10) -> dict:
    """What ``hpc-cli expert score`` prints: the profile's hit rates on the trace, the held-out
    (k-fold) hit rate of profiles built like it, and the first-routed policies for comparison."""
    if (profile.n_layers, profile.n_expert) != (trace.n_layers, trace.n_expert):
        raise CacheFileError(f"the profile is {profile.n_layers} layers x {profile.n_expert} experts, the trace "
                             f"{trace.n_layers} x {trace.n_expert}", hint="score a profile on its own model's traces")
    s = profile.slots if slots is None else slots
    mask = profile.resident_mask(s)
    e, l, per_layer = hit_rates(trace.records, mask)
    out = {"slots": s, "resident": int(mask.sum()), "tokens": trace.tokens, "n_layers": trace.n_layers,
           "n_expert": trace.n_expert, "top_k": trace.top_k, "h_expert": e, "h_layer": l,
           "h_expert_per_layer": [float(x) for x in per_layer]}
    if folds > 1:
        out["kfold"] = kfold(trace.records, trace.n_expert, s, folds)
    out["policies"] = {
        "first-routed": simulate_first_routed(trace.records, trace.n_expert, s, per_layer=False),
        "per-layer-first-routed": simulate_first_routed(trace.records, trace.n_expert, s, per_layer=True),
    }
    return out


def synthetic_trace(tokens: int, n_layers: int, n_expert: int, top_k: int, skew: float = 1.0,
                    seed: int = 0, sample_seed: int | None = None) -> np.ndarray:
    """A routing trace with a Zipf(``skew``) popularity over each layer's experts: expert of
    popularity rank ``r`` (1-based) has weight ``r ** -skew``, the ranks a random permutation per
    layer (from ``seed``). Each token picks ``top_k`` distinct experts per layer, sampled without
    replacement in proportion to weight (Gumbel top-k, noise from ``sample_seed``, default
    ``seed + 1``): two traces of one ``seed`` and different ``sample_seed`` are independent draws
    of one routing distribution. ``skew`` 0 is uniform routing."""
    perms = np.random.default_rng(seed)
    rng = np.random.default_rng(seed + 1 if sample_seed is None else sample_seed)
    logp = -skew * np.log(np.arange(1, n_expert + 1, dtype=np.float64))
    out = np.empty((tokens, n_layers, top_k), dtype=np.int16)
    for layer in range(n_layers):
        perm = perms.permutation(n_expert)
        g = logp[None, :] + rng.gumbel(size=(tokens, n_expert))
        top = np.argpartition(-g, top_k - 1, axis=1)[:, :top_k]
        out[:, layer, :] = perm[top]
    return out


def iter_ranked(profile: ExpertProfile, slots: int | None = None) -> Iterable[tuple[int, int]]:
    for layer, expert in profile.top(slots):
        yield int(layer), int(expert)
