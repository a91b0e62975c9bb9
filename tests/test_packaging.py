"""The package's metadata says what is tested: the dependency ranges hold the pins `make test` and `make
test-compat` install (and the GPU machine's torch), and the ``serve`` extra provides every third-party module that
`flashdecode serve` and `flashdecode bench serve` import."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

requirements = pytest.importorskip("packaging.requirements")

ROOT = Path(__file__).resolve().parents[1]
# Modules that a distribution other than the one of their name provides (FastAPI is built on Starlette)
PROVIDED_BY = {"starlette": "fastapi"}


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _specifiers(reqs) -> dict:
    return {r.name: r.specifier for r in map(requirements.Requirement, reqs)}


def _makefile_pins(name: str) -> dict:
    text = (ROOT / "Makefile").read_text()
    line = re.search(rf"^{name}\s*:=(.*)$", text, re.M).group(1)
    return dict(re.findall(r"([a-z]+)==([\d.]+)", line))


@pytest.mark.parametrize("pins", ["CPU_PINS", "COMPAT_PINS"])
def test_dependency_ranges_hold_the_tested_pins(pins):
    deps = _specifiers(_project()["dependencies"])
    for name, version in _makefile_pins(pins).items():
        assert version in deps[name], f"{name}=={version} ({pins}) is outside pyproject's {name}{deps[name]}"
    assert "2.11.0" in deps["torch"]  # the GPU machine's torch (docs/benchmarks.md records)


def _third_party_imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"flashdecode", "__future__"}


def test_the_serve_extra_provides_what_serve_and_bench_serve_import():
    project = _project()
    provided = set(_specifiers(project["dependencies"])) | set(_specifiers(project["optional-dependencies"]["serve"]))
    files = sorted((ROOT / "flashdecode" / "engine" / "server").glob("*.py")) + [ROOT / "flashdecode" / "bench" /
                                                                                 "serve.py"]
    for path in files:
        for module in _third_party_imports(path):
            assert PROVIDED_BY.get(module, module) in provided, f"{path.name} imports {module}, not in [serve]"
