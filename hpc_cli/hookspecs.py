"""The plugin contract: five hooks, each taking a callback (ARCHITECTURE.md §3).

Built-in plugins (``hpc_plugins.*``) implement these exactly as third-party packages do.
docs/plugins.md documents every hook with its exact signature; a test checks the document.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("hpc_cli")


@hookspec
def hpc_register_kv_profiles(register):
    """Register KV storage profiles: call ``register(profile)`` with a ``hpc_cli.kv_profile.KVProfile``."""


@hookspec
def hpc_register_spec_backends(register):
    """Register speculative backends: call ``register(backend)`` with a ``hpc_cli.spec_backend.SpecBackend``."""


@hookspec
def hpc_register_cache_modes(register):
    """Register cache modes: call ``register(mode)`` with a ``hpc_cli.cache_mode.CacheMode``."""


@hookspec
def hpc_register_shared_stores(register):
    """Register shared cache stores: call ``register(kind)`` with a ``hpc_cli.shared_store.SharedStoreKind``."""


@hookspec
def hpc_register_commands(cli):
    """Add click commands or groups to the ``hpc-cli`` group: ``cli.add_command(...)`` or ``@cli.command()``."""
