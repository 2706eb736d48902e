"""Commands that only read settings or plugins (`hpc-cli plugins`, `config`, `top`, `kv`) must
not import torch: it costs seconds on every start."""

from __future__ import annotations

import subprocess
import sys


def test_plugins_and_settings_do_not_import_torch():
    code = ("import sys, hpc_cli.plugins as p, hpc_cli.settings as s; p.registries(); s.load_settings(None, environ={}); "
            "import hpc_cli.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
