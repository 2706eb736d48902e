"""Admission's choice and capacity (spec §6.2-6.3).

:func:`quote` prices the sources a matched prompt could resume from (the root, ``s*`` the
deepest usable snapshot, ``s_dev`` the deepest whose path, tail and image are all on the
device), picks the cheapest, and checks capacity in the fallback order chosen, ``s_dev``,
root. ``need_pages(s) = entitlement - F_s//64 + host-only path blocks + host-only tail``, in
page bundles. :func:`backfill_proof` keeps §6.3's backfill arithmetic (not issued).
"""

from __future__ import annotations

from hpc_cli.cache.cost import CacheCostModel
from hpc_cli.cache.records import Quote, Readiness
from hpc_cli.cache.snapshot import Snapshot
from hpc_cli.cache.tree import ABSENT, FILLING, RESIDENT, MatchResult


def quote(m: MatchResult, n: int, *, entitlement_pages: int, free_pages: int, total_pages: int,
          evictable: int, cost: CacheCostModel, block_bytes: int, image_bytes: int,
          epoch: int) -> Quote:
    """The quote of a prompt of ``n`` tokens matched as ``m``, with ``evictable`` page bundles
    in the device LRU; see :meth:`hpc_cli.cache.index.PrefixIndex.quote`."""
    path = m.path
    # Prefix scan up to the deepest candidate's anchor: host-only blocks, blocks in the LRU,
    # and the first block another admission is filling.
    deepest = max((s.anchor.depth for s in m.candidates), default=-1)
    host_only = [0] * (deepest + 2)
    in_lru = [0] * (deepest + 2)
    filling_at = deepest + 1
    ho = lr = 0
    for i in range(deepest + 1):
        node = path[i]
        st = node.device_state
        if st == ABSENT:
            ho += 1
        elif st == FILLING and filling_at > i:
            filling_at = i
        if node.lru_list is not None:
            lr += 1
        host_only[i + 1] = ho
        in_lru[i + 1] = lr
    bb = block_bytes

    def describe(s: Snapshot | None) -> tuple[int, int, int, float]:
        if s is None:
            return entitlement_pages, free_pages + evictable, 0, cost.prefill_seconds(0, n)
        d = s.anchor.depth + 1
        nbytes = host_only[d] * bb
        need = entitlement_pages - d + host_only[d]
        own = in_lru[d]
        if s.tail_tokens:
            if s.tail_device_state == ABSENT:
                nbytes += bb
                need += 1
            elif s.lru_list is not None:
                own += 1
        if s.device_state != RESIDENT:
            nbytes += image_bytes
        secs = cost.restore_seconds(nbytes) + cost.prefill_seconds(s.frontier, n - s.frontier)
        return need, free_pages + evictable - own, nbytes, secs

    s_star = s_dev = None
    for s in reversed(m.candidates):
        if s.anchor.depth >= filling_at or s.tail_device_state == FILLING:
            continue  # another admission is filling a block of it (§6.3)
        if s_star is None:
            s_star = s
        if s.device_state == RESIDENT and host_only[s.anchor.depth + 1] == 0 and \
                (not s.tail_tokens or s.tail_device_state == RESIDENT):
            s_dev = s
            break
    options: list[Snapshot | None] = [None]
    if s_star is not None:
        options.append(s_star)
    if s_dev is not None and s_dev is not s_star:
        options.append(s_dev)
    described = {id(s): describe(s) for s in options}
    # Minimum cost; ties favour fewer transferred bytes, then the deeper frontier.
    ranked = sorted(options, key=lambda s: (described[id(s)][3], described[id(s)][2],
                                             -(s.frontier if s else 0)))
    chosen = ranked[0]
    order: list[Snapshot | None] = [chosen]
    for s in (s_dev, None):
        if s is not chosen and s not in order:
            order.append(s)
    found = False
    pick: Snapshot | None = None
    for s in order:
        need, avail, _, _ = described[id(s)]
        if need <= avail:
            pick, found = s, True
            break
    if found:
        readiness = Readiness.READY
    elif entitlement_pages > total_pages:
        readiness = Readiness.PERMANENTLY_INFEASIBLE
    else:
        readiness = Readiness.TEMPORARILY_BLOCKED
    src = pick
    need, avail, nbytes, secs = described[id(src)]
    d = src.anchor.depth + 1 if src is not None else 0
    qpath = path[:d]
    return Quote(
        readiness=readiness, match=m, source=src,
        reuse_tokens=src.frontier if src is not None else 0,
        cached_prefix_tokens=m.cached_prefix_tokens, path=qpath,
        restore_blocks=[nd for nd in qpath if nd.device_state == ABSENT],
        restore_tail=bool(src is not None and src.tail_tokens and src.tail_device_state == ABSENT),
        restore_image=bool(src is not None and src.device_state != RESIDENT),
        restore_bytes=nbytes, need_pages=need, available_pages=avail, cost_seconds=secs,
        epoch=epoch, candidates=[(s, described[id(s)][3]) for s in options])


def backfill_proof(need_borrower: int, need_head_root: int, free_pages: int, evictable_pages: int,
                   donor_released_pages: int) -> bool:
    """Spec §6.3's backfill arithmetic: a borrower may overtake a blocked FIFO head only if
    ``need(borrower) + need(head root) <= free + all evictable + donor entitlements released``.
    Hybrid mode does not issue the proof (a blocked head is never overtaken); it is kept as a
    function so the arithmetic is tested and available."""
    return need_borrower + need_head_root <= free_pages + evictable_pages + donor_released_pages
