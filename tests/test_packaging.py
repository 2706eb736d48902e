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


# modules the code imports only on CUDA machines or behind an ImportError: triton ships with
# torch's CUDA builds; cuda-python and flash-linear-attention are the [cuda] and [fla] extras
OPTIONAL_IMPORTS = {"triton": None, "cuda": "cuda", "fla": "fla"}


def _runtime_nodes(tree):
    """Every node of a module but those under ``if TYPE_CHECKING:`` (imports for type hints)."""
    import ast

    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level modules imported at run time anywhere in the shipped packages -> their files."""
    import ast
    import sys

    own = {"hpc_cli", "hpc_plugins", "hpc_kernels"}
    found: dict[str, set[str]] = {}
    for folder in ("hpc_cli", "plugins", "hpc_kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in _runtime_nodes(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in own:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _requirement_name(req: str) -> str:
    import re

    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def test_every_runtime_import_is_a_dependency():
    """What `hpc-cli top`, the TUI and the server import at run time is installed by
    `pip install -e .` (httpx was only in the test extra)."""
    from importlib.metadata import packages_distributions

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = {_requirement_name(r) for r in data["project"]["dependencies"]}
    extras = {name: {_requirement_name(r) for r in reqs}
              for name, reqs in data["project"]["optional-dependencies"].items()}
    dists = packages_distributions()
    missing = []
    for module, files in sorted(_third_party_imports().items()):
        if module in OPTIONAL_IMPORTS:
            extra = OPTIONAL_IMPORTS[module]
            assert extra is None or extra in extras, f"{module} needs the [{extra}] extra"
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & runtime:
            missing.append(f"{module} ({', '.join(sorted(files)[:3])})")
    assert not missing, "imported at run time but not in [project] dependencies: " + "; ".join(missing)
    assert "httpx" in runtime  # hpc-cli top
