"""The layering of docs/architecture.md ("## Layers"), checked on the source: which package modules each layer may
import. Parses imports (top level and inside functions) without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flashdecode"

# layer (a folder or module of the package) -> package prefixes it must not import
FORBIDDEN = {
    "kernels": ("flashdecode.ops", "flashdecode.engine", "flashdecode.bench", "flashdecode.cli", "flashdecode.config",
                "flashdecode.heuristics"),
    "heuristics.py": ("flashdecode.ops", "flashdecode.kernels", "flashdecode.engine", "flashdecode.bench"),
    "config.py": ("flashdecode.ops", "flashdecode.kernels", "flashdecode.engine", "flashdecode.bench"),
    "reference.py": ("flashdecode.ops", "flashdecode.kernels", "flashdecode.engine", "flashdecode.bench"),
    "ops": ("flashdecode.engine", "flashdecode.bench", "flashdecode.cli"),
    "engine": ("flashdecode.bench",),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _modules(layer: str) -> list[Path]:
    target = PACKAGE / layer
    return sorted(target.rglob("*.py")) if target.is_dir() else [target]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_from_layers_above(layer):
    bad = [f"{path.relative_to(PACKAGE.parent)} imports {name}" for path in _modules(layer) for name in _imports(path)
           if name.startswith(FORBIDDEN[layer])]
    assert not bad, "\n".join(bad)


def test_package_never_imports_the_probes():
    bad = [f"{path.relative_to(PACKAGE.parent)} imports {name}" for path in PACKAGE.rglob("*.py")
           for name in _imports(path) if name.split(".")[0] in ("benchmarks", "scripts", "tests")]
    assert not bad, "\n".join(bad)
