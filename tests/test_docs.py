"""docs/plugins.md documents every hook with its exact signature and docstring."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from hpc_cli import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def test_every_hook_is_documented_with_its_signature():
    text = DOC.read_text()
    documented = dict(re.findall(r"^### `(hpc_\w+)(\(.*\))`$", text, flags=re.M))
    hooks = {name: fn for name, fn in vars(hookspecs).items() if name.startswith("hpc_") and callable(fn)}
    assert set(documented) == set(hooks), "docs/plugins.md and hookspecs.py list different hooks"
    for name, fn in hooks.items():
        assert documented[name] == str(inspect.signature(fn)), name
        # the hook's one-line docstring is the first paragraph of its section
        section = text.split(f"### `{name}")[1]
        assert inspect.getdoc(fn).splitlines()[0].replace("``", "`") in section, name


def test_configuration_reference_is_in_sync():
    """docs/configuration.md is what `hpc-cli config reference` prints (regenerate it with
    `hpc-cli config reference -o docs/configuration.md`)."""
    from hpc_cli.config_reference import reference_markdown

    text = reference_markdown()
    assert (DOC.parent / "configuration.md").read_text() == text
    from hpc_cli.settings import HpcSettings

    for section, field in HpcSettings.model_fields.items():
        for name in field.annotation.model_fields:
            assert f"`HPC_{section.upper()}__{name.upper()}`" in text, f"{section}.{name} missing"
