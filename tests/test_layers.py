"""Data flows one way through the stages: no module imports a module of a later stage or the
facade, at module level or inside a function (docs/architecture.md draws the same order)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autoparallel"

# each group may import its own modules and those of earlier groups, never later ones
LAYERS = [
    ("base", {"_torchvision_compat", "errors", "fqn", "graph", "placement", "mesh", "precision", "progress",
              "pickling", "runtime_kernels", "constraints", "jsonfields", "units"}),
    ("the plan and its views", {"results", "pipeline_plan", "plan", "summary", "explain", "plot", "table"}),
    ("capture", {"tracer"}),
    ("strategies", {"strategies"}),
    ("rewrites", {"rewrites"}),
    ("planning", {"solver", "options", "validate", "cache", "recipes", "profile"}),
    ("lowering", {"passes"}),
    ("module", {"codegen"}),
    ("facade", {"api", "config", "demo", "cli", "lightning", "__init__", "__main__"}),
]
VIEWS = {"summary", "explain", "plot", "table"}
"""Readers of a Plan: the solver package computes what they show and imports none of them."""


def _layer(top: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(f"autoparallel.{top} belongs to no layer of tests/test_layers.py: add it to one")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, first name under ``autoparallel``) of every import of the package in ``path``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts if path.name == "__init__.py" else parts[:-1]
    package = package[:-1] if package[-1] == "__init__" else package
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            names = [module + [a.name] for a in node.names] if len(module) == 1 else [module]
        else:
            continue
        found += [(node.lineno, n[1]) for n in names if n[0] == "autoparallel" and len(n) > 1]
    return found


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_of_a_later_stage(path):
    rel = path.relative_to(PACKAGE)
    top = rel.parts[0].removesuffix(".py")
    own = _layer(top)
    for line, target in _imports(path):
        assert _layer(target) <= own, (f"{rel}:{line} imports autoparallel.{target} "
                                       f"({LAYERS[_layer(target)][0]}), a later stage than {LAYERS[own][0]}")
        if top == "solver":
            assert target not in VIEWS, f"{rel}:{line} imports the view autoparallel.{target}"


def test_the_checker_sees_relative_and_function_level_imports():
    probe = PACKAGE / "solver" / "pipeline.py"
    targets = {t for _, t in _imports(probe)}
    assert {"cache", "options", "strategies", "tracer"} <= targets
