"""The oracle drafter: proposes the target's own greedy continuation from a precomputed reference.

For tests and benchmarks only: with greedy sampling every draft is accepted while the output
follows the reference, so it shows the ceiling of the propose/verify/rollback machinery.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from hpc_cli.spec_backend import SpecBackend


class OracleDrafter:
    name = "oracle"
    capture: tuple[int, ...] = ()
    needs_hidden = False

    def __init__(self, references: Mapping[tuple[int, ...], Sequence[int]], fill: int = 0) -> None:
        self.references = {tuple(k): list(v) for k, v in references.items()}
        self.fill = fill

    def bind(self, storage, backend_storage, states) -> None:
        pass

    def admitted(self, lane) -> None:
        lane.backend_frontier = None

    def observe(self, *a, **k) -> None:
        pass

    def propose(self, lanes, k: int, states) -> list[list[int]]:
        out = []
        for lane in lanes:
            ref = self.references.get(tuple(lane.tokens[:lane.n_prompt]), [])
            n = len(lane.generated)  # the drafts follow generated[-1] (the next token)
            got = list(ref[n:n + k])
            out.append(got + [self.fill] * (k - len(got)))
        return out


class OracleBackend(SpecBackend):
    """Not registered (it needs references): pass an instance to ``Engine(speculative=...)``."""

    name = "oracle"
    description = "proposes a precomputed greedy continuation (tests, benchmarks)"

    def __init__(self, references: Mapping[tuple[int, ...], Sequence[int]] | None = None) -> None:
        self.references = dict(references or {})

    def build_drafter(self, model, path=None, seed=None):
        return OracleDrafter(self.references)
