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
    "timing.py": ("flashdecode.ops", "flashdecode.kernels", "flashdecode.engine", "flashdecode.bench",
                  "flashdecode.distributed"),
    "flash_attn_interface.py": ("flashdecode.engine", "flashdecode.bench", "flashdecode.cli",
                                "flashdecode.distributed", "flashdecode.integrations"),
    "integrations": ("flashdecode.engine", "flashdecode.bench", "flashdecode.cli", "flashdecode.distributed"),
}
# the drop-in (flash_attn_interface) and the integrations sit beside the core: nothing else in the package imports them
DROP_INS = ("flashdecode.flash_attn_interface", "flashdecode.integrations")


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


def test_core_never_imports_the_drop_ins():
    # the drop-ins themselves, and the user-facing benchmarks, which time them against their peers
    own = ("flash_attn_interface.py", "integrations", "bench")
    bad = [f"{path.relative_to(PACKAGE.parent)} imports {name}" for path in PACKAGE.rglob("*.py")
           if path.relative_to(PACKAGE).parts[0] not in own for name in _imports(path) if name.startswith(DROP_INS)]
    assert not bad, "\n".join(bad)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path) -> set[str]:
    """What each import statement names: ``import a.b`` a.b, ``from a import b, c`` a.b and a.c (never a alone: the
    package's __init__ runs first, but the statement takes b and c)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _import_graph() -> dict[str, set[str]]:
    """Package module -> the package modules it imports (at the top or inside functions): ``from flashdecode.ops
    import attention`` names the module flashdecode.ops.attention, ``from flashdecode.ops.attention import x`` the
    module itself (a name that is no module resolves to the longest module prefix)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imported_names(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_package():
    # every import counts, a function's lazy one too: a circle through one is still a circle of the design
    circles = _cycles(_import_graph())
    assert not circles, "\n".join(" <-> ".join(circle) for circle in circles)


def test_sinks_step_is_a_leaf_of_the_ops():
    # ops/sinks.py is applied by the ops after their kernels: it imports none of them (no call back into the API)
    imported = _import_graph()["flashdecode.ops.sinks"]
    assert imported <= {"flashdecode.ops.checks"}, imported
