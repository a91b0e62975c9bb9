"""Kernel argument lists stay short: related arguments travel as tuples (the decode kernels' constexpr groups in
kernels/decode_args.py, strides of one tensor, (score scale, softcap), ...). benchmarks/probes/kernel_codegen.py
shows on the CPU that such a grouping leaves the compiled code unchanged."""

from __future__ import annotations

import ast
import pathlib

import flashdecode

MAX_KERNEL_ARGS = 40


def _jit_functions():
    """(path, function node, decorator nodes) of every @triton.jit / @gluon.jit function in the package."""
    root = pathlib.Path(flashdecode.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                jit = [d for d in node.decorator_list if "jit" in ast.unparse(d)]
                if jit:
                    yield path.relative_to(root.parent), node, jit


def test_no_kernel_takes_more_than_40_arguments():
    too_long = [f"{path}: {node.name} takes {len(node.args.args)}" for path, node, _ in _jit_functions()
                if len(node.args.args) > MAX_KERNEL_ARGS]
    assert not too_long, too_long
    assert sum(1 for _ in _jit_functions()) > 50  # the walk found the kernels


def test_unspecialised_arguments_stay_separate_parameters():
    """do_not_specialize must name parameters, never a tuple that groups them: Triton 3.6 specialises a tuple's
    elements (equal to 1, divisible by 16) whatever do_not_specialize says, so lengths and windows that must not
    compile one variant per value stay separate arguments (and a name that is no parameter is silently ignored)."""
    checked = 0
    for path, node, decorators in _jit_functions():
        params = {a.arg for a in node.args.args}
        for decorator in decorators:
            for keyword in getattr(decorator, "keywords", []):
                if keyword.arg == "do_not_specialize":
                    names = ast.literal_eval(keyword.value)
                    assert set(names) <= params, (f"{path}: {node.name}", sorted(set(names) - params))
                    checked += 1
    assert checked >= 3  # the backward kernels and the forward
