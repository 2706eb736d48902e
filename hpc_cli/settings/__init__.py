"""Settings: profile TOML < environment HPC_* < CLI flags, with derived defaults (spec §14.2).

A profile file is a TOML document with the sections below. Every key can also be set by an
environment variable ``HPC_<SECTION>__<KEY>`` (for example ``HPC_CACHE__HOST_CACHE_MIB=0``) and
most by a CLI flag. The layers merge key by key, highest first: CLI flags, then the environment,
then the profile file, then the defaults; a flag left unset never masks a lower layer.

:func:`load_settings` returns a :class:`ResolvedSettings` with the validated settings, the layer
every value came from, and the effective values the cache mode derives for what was left unset.
One module an idea: :mod:`.sections` the tables, :mod:`.profiles` the profile files,
:mod:`.layers` the layers and their origins, :mod:`.resolve` loading and validation.
"""

from hpc_cli.settings.layers import cli_layer, describe_origin, env_layer, merge, origin, validation_error
from hpc_cli.settings.profiles import read_profile, resolve_profile_path, shipped_profiles
from hpc_cli.settings.resolve import load_settings
from hpc_cli.settings.sections import (ENV_PREFIX, LAYERS, SECTIONS, CacheSettings, EngineSettings, ExpertsSettings,
                                       HpcSettings, KVSettings, ModelSettings, ResolvedSettings, ServerSettings,
                                       SpeculativeSettings, TuiSettings, env_var)

__all__ = ["ENV_PREFIX", "LAYERS", "SECTIONS", "CacheSettings", "EngineSettings", "ExpertsSettings", "HpcSettings",
           "KVSettings", "ModelSettings", "ResolvedSettings", "ServerSettings", "SpeculativeSettings", "TuiSettings",
           "cli_layer", "describe_origin", "env_layer", "env_var", "load_settings", "merge", "origin", "read_profile",
           "resolve_profile_path", "shipped_profiles", "validation_error"]
