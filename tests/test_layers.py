"""The layout of docs/architecture.md, checked on the source: imports point down the layers, no module imports itself
back through a circle (lazy imports inside functions count: a circle through one is still a circle of the design),
and no file in src/ outgrows one job without saying why."""

from __future__ import annotations

import ast
from pathlib import Path

import leantune

SRC = Path(leantune.__file__).parent
# Layers of docs/architecture.md, bottom (0) to top. A module may import its own unit and any unit of a lower layer;
# two units on one layer never import each other. "leantune" is the package root (its __init__).
LAYERS = {
    "errors": 0,
    "ops": 1,
    "patch": 2, "quantize": 2, "assets": 2, "heap": 2, "graphs": 2,
    "leantune": 3, "distributed": 3, "integrations": 3,
    "train": 4, "bench": 4,
    "cli": 5,
    "__main__": 6,
}
MAX_LINES = 500  # above it a module docstring must say why ("longer than ... because")


def module_name(path: Path) -> str:
    parts = ("leantune",) + path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(name: str) -> bool:
    return (SRC.parent / name.replace(".", "/") / "__init__.py").exists()


def exists(name: str) -> bool:
    base = SRC.parent / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imported_modules(path: Path) -> set[str]:
    """leantune modules that ``path`` imports anywhere in the file; ``from pkg import name`` counts as pkg.name when
    that is a module, else as pkg."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "leantune"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "leantune":
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if exists(candidate) else target)
    return {name for name in found if exists(name)}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p) - {module_name(p)} for p in sorted(SRC.rglob("*.py"))}


def unit(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "leantune"


def test_every_unit_has_a_layer():
    assert {unit(name) for name in graph()} == set(LAYERS)


def test_imports_point_down_the_layers():
    wrong = []
    for source, targets in graph().items():
        for target in targets:
            a, b = unit(source), unit(target)
            if a != b and LAYERS[b] >= LAYERS[a]:
                wrong.append(f"{source} -> {target}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    edges = graph()
    state: dict[str, str] = {}
    circles = []

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == "open":
            circles.append(" -> ".join(trail[trail.index(name):] + [name]))
            return
        if state.get(name) == "done":
            return
        state[name] = "open"
        for nxt in sorted(edges.get(name, ())):
            visit(nxt, trail + [name])
        state[name] = "done"

    for name in sorted(edges):
        visit(name, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_graph_sees_relative_and_lazy_imports():
    """The walker itself: a relative import two levels up and an import inside a function are both found."""
    edges = graph()
    assert "leantune.ops" in edges["leantune.patch.forwards"]  # from .. import ops
    assert "leantune.errors" in edges["leantune.cli"]  # only inside main()
    assert is_package("leantune.ops.lora") and not is_package("leantune.ops.rope")


def test_no_file_grows_past_one_job_without_a_reason():
    long = []
    for path in SRC.rglob("*.py"):
        lines = path.read_text().splitlines()
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if len(lines) > MAX_LINES and "longer than" not in doc:
            long.append(f"{path.relative_to(SRC)}: {len(lines)} lines")
    assert not long, long
