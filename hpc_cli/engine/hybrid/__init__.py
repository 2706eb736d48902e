"""The hybrid cache mode's binding (spec §6-§9): :class:`HybridBinding` in :mod:`.binding`, its
parts one module each (:mod:`.restore`, :mod:`.commit`, :mod:`.publish`, :mod:`.transfers`)."""

from hpc_cli.engine.hybrid.binding import HybridBinding
from hpc_cli.engine.hybrid.restore import common_prefix, planner_hints

__all__ = ["HybridBinding", "common_prefix", "planner_hints"]
