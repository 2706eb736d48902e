"""Packaging: every package folder is listed in pyproject.toml; profiles ship as package data."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(data["tool"]["setuptools"]["packages"])
    mapping = data["tool"]["setuptools"]["package-dir"]
    found = set()
    for init in ROOT.glob("**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in ("tests", "examples", "build") or any(p.startswith(".") for p in rel.parts):
            continue
        folder = "/".join(rel.parts)
        for pkg, path in mapping.items():
            if folder == path:
                found.add(pkg)
                break
            if folder.startswith(path + "/"):
                found.add(pkg + "." + folder[len(path) + 1:].replace("/", "."))
                break
    assert found == listed, f"pyproject lists {sorted(listed)}, folders are {sorted(found)}"


def test_console_script_and_entry_point_group():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["scripts"]["hpc-cli"] == "hpc_cli.cli:main"
    assert "torch==" not in str(data["project"]["dependencies"])  # never pin the CUDA build


def test_profiles_are_package_data():
    from importlib import resources

    names = {p.name for p in resources.files("hpc_cli.profiles").iterdir()}
    assert {"default.toml", "int8-mtp.toml"} <= names
