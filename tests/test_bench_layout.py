"""The layout of `leantune.bench`: the report reads results only, the command-line module loads nothing heavy,
and the op names that `bench ops --help` lists are the cases it runs."""

from __future__ import annotations

import ast
from pathlib import Path

import leantune.bench

BENCH = Path(leantune.bench.__file__).parent
HEAVY = {"torch", "transformers", "peft", "triton", "matplotlib", "liger_kernel", "cut_cross_entropy"}


def _module_level_imports(path: Path) -> tuple[set[str], set[str]]:
    """(sibling modules of bench/, top-level packages) imported at module level of ``path`` (not inside functions)."""
    siblings, packages = set(), set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y  /  from . import x
                siblings |= {node.module} if node.module else {a.name for a in node.names}
            elif node.level == 0:
                packages.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            packages |= {a.name.split(".")[0] for a in node.names}
    return siblings, packages


def test_the_report_reads_results_only_and_the_harness_stands_alone():
    """Circles and layers are checked for all of src/ (test_layers.py); inside bench the report reads stored JSON
    (no measuring module) and the harness needs nothing of bench."""
    graph = {p.stem: set() for p in BENCH.glob("*.py")}
    for p in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                graph[p.stem] |= {node.module} if node.module else {a.name for a in node.names}
    assert not graph["report"] & {"e2e", "ops", "op_cases", "max_context", "step"}
    assert not graph["harness"] - {"errors"} and "harness" in graph["e2e"] & graph["ops"] & graph["report"]


def test_the_command_line_module_imports_nothing_heavy_at_load():
    """`leantune --help` must not wait for torch: bench/cli.py and what it loads import heavy packages lazily."""
    for name in ("cli", "harness"):
        siblings, packages = _module_level_imports(BENCH / f"{name}.py")
        assert not packages & HEAVY, (name, packages & HEAVY)
        assert siblings <= {"harness"}, (name, siblings)


def test_the_op_names_of_the_help_are_the_cases_that_run():
    from leantune.bench.harness import OP_NAMES
    from leantune.bench.op_cases import CASES

    assert tuple(CASES) == OP_NAMES
