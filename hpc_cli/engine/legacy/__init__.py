"""Cache mode ``legacy``: the checkpoint catalog (:mod:`hpc_cli.cache.catalog`) on the same
device pools, state slots, host slabs and transfer engine as the hybrid binding
(:mod:`.binding`, whose module doc tells the mode)."""

from hpc_cli.engine.legacy.binding import LegacyBinding
from hpc_cli.engine.legacy.config import LegacyConfig, legacy_config, legacy_defaults

__all__ = ["LegacyBinding", "LegacyConfig", "legacy_config", "legacy_defaults"]
