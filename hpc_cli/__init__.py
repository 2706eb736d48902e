"""hpc-cli: a serving engine for hybrid-recurrent language models with a hybrid prefix cache."""

import pluggy

__version__ = "0.1.0"

#: Decorates a plugin's hook implementations: ``@hpc_cli.hookimpl``.
hookimpl = pluggy.HookimplMarker("hpc_cli")
