"""The layering, as an import scan of the package (ARCHITECTURE.md, docs/architecture.md):

    server -> engine.api          engine -> model, memory, cache (and its own helpers)
    model  -> memory, kernels     memory -> kernels               cache -> errors only
    speculative -> model, memory, kernels (the drafters' networks, as the model's layers)

Every import between the packages of ``hpc_cli`` (and of ``hpc_kernels``) must be an allowed
arrow or one of the few known exceptions listed below with their reasons; a known exception that
no longer occurs must leave the list, so it only shrinks. No module imports another module's
private names (``from x import _y``)."""

from __future__ import annotations

import ast
from pathlib import Path

import hpc_cli

ROOT = Path(hpc_cli.__file__).parent

#: modules at the package's top level every layer may use (errors, shapes, settings types)
LEAVES = {"errors", "shapes", "kv_profile", "progress"}

#: package -> what it may import besides itself and LEAVES ("engine.api": that module only)
ALLOWED = {
    "cache": set(),
    "memory": {"hpc_kernels"},
    "model": {"memory", "hpc_kernels", "plugins"},
    "experts": {"model", "memory"},
    # the engine's public types; the drafters' own networks run the kernels as the model's layers do
    "speculative": {"model", "memory", "hpc_kernels", "spec_backend", "engine.api"},
    "engine": {"model", "memory", "cache", "experts", "speculative", "cache_mode", "shared_store", "settings",
               "plugins", "hookspecs", "spec_backend"},
    "server": {"engine.api", "settings"},
}

#: arrows that break the layering today, with why; none may be added, each removed once fixed
KNOWN = {
    ("server", "model"): "the streaming detokenizer (IncrementalDecoder) and the image preprocessor",
    ("speculative", "engine.sampling"): "the verify pass samples with the engine's sampler",
}


def _target(module: str) -> str | None:
    """The layer an absolute import names: ``engine.api``-style for the engine, else the first
    component under ``hpc_cli``; ``hpc_kernels`` for the kernels; None outside the project."""
    parts = module.split(".")
    if parts[0] == "hpc_kernels":
        return "hpc_kernels"
    if parts[0] != "hpc_cli" or len(parts) < 2:
        return None
    return ".".join(parts[1:3]) if parts[1] == "engine" and len(parts) > 2 else parts[1]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def _arrows() -> dict[tuple[str, str], set[str]]:
    arrows: dict[tuple[str, str], set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2 or rel[0] not in ALLOWED:
            continue
        layer = rel[0]
        for module, _ in _imports(path):
            target = _target(module)
            if target is None or target.split(".")[0] == layer:
                continue
            arrows.setdefault((layer, target), set()).add(str(path.relative_to(ROOT)))
    return arrows


def _allowed(layer: str, target: str) -> bool:
    if target in LEAVES:
        return True
    allowed = ALLOWED[layer]
    return target in allowed or target.split(".")[0] in allowed


def test_every_import_between_layers_is_an_allowed_arrow():
    arrows = _arrows()
    bad = {a: sorted(files) for a, files in arrows.items() if not _allowed(*a) and a not in KNOWN}
    assert not bad, f"imports against the layering (allow them in ALLOWED with a reason, or fix): {bad}"


def test_known_exceptions_still_occur():
    arrows = _arrows()
    gone = [a for a in KNOWN if a not in arrows]
    assert not gone, f"these exceptions no longer occur: remove them from KNOWN: {gone}"


def test_the_cache_imports_only_errors():
    arrows = _arrows()
    assert {t for (layer, t) in arrows if layer == "cache"} <= {"errors"}


def test_no_private_names_cross_modules():
    roots = [ROOT, ROOT.parent / "plugins", ROOT.parent / "hpc_kernels"]
    bad = []
    for root in roots:
        for path in root.rglob("*.py"):
            for module, names in _imports(path):
                bad += [f"{path.name}: from {module} import {n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad
