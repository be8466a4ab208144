"""The layers cannot erode: imports run downward only, no module cycle, no first-party import inside a function.

The order, bottom first (docs/development.md's layout section draws it). A module may import from its own layer and the
layers below it; asyncpp/job.py, the composition root, is the only module that sees them all:

    typed, host < schedules < config < parallel < model_zoo, data < optim < core < train < pipeline
      < reference, analysis < job

An import inside a function is how an upward import or a cycle hides from this test (and from a reader), so
library code has none: every first-party import sits at the top of its module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [
    {"asyncpp.typed", "asyncpp.host", "asyncpp"},
    {"asyncpp.schedules"},
    {"asyncpp.config"},
    {"asyncpp.parallel"},
    {"model_zoo", "data"},
    {"asyncpp.optim"},
    {"asyncpp.core"},
    {"asyncpp.train"},
    {"asyncpp.pipeline"},
    {"asyncpp.reference", "asyncpp.analysis"},
    {"asyncpp.job"},
]
FIRST_PARTY = ("asyncpp", "model_zoo", "data")
LIBRARY = "asyncpp"  # model_zoo and data import their optional or heavy backends lazily (TE, megatron)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    return {module_name(p): p for top in FIRST_PARTY for p in sorted((ROOT / top).rglob("*.py"))}


def layer_of(module: str) -> int:
    """The layer of the most specific package in LAYERS that holds `module` (asyncpp itself: its __init__)."""
    found = [(len(m), level) for level, members in enumerate(LAYERS) for m in members
             if module == m or module.startswith(m + ".")]
    if not found:
        raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and to docs/development.md's picture)")
    return max(found)[1]


def imported(node: ast.AST, modules: dict[str, Path]) -> Iterator[str]:
    """The first-party modules an import statement names (`from a.b import c` is a.b.c when that is a module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                 for a in node.names]
    else:
        return
    yield from (n for n in names if n.split(".")[0] in FIRST_PARTY)


def import_graph(at_runtime: bool = False) -> dict[str, set[str]]:
    """Every module's first-party imports; `at_runtime`: without those under `if TYPE_CHECKING:`, which never run
    (a config section's check names RunConfig in its annotation, and run.py imports the section)."""
    modules = library_modules()
    graph = {}
    for m, p in modules.items():
        tree = ast.parse(p.read_text())
        skipped = {id(n) for block in ast.walk(tree) if at_runtime and is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}
        graph[m] = {t for node in ast.walk(tree) if id(node) not in skipped for t in imported(node, modules)}
    return graph


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def test_every_library_module_has_a_layer():
    for m in library_modules():
        layer_of(m)


def test_imports_run_downward_only():
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in import_graph().items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycle():
    """Import-time cycles. The order check above still sees the annotation-only imports."""
    graph = import_graph(at_runtime=True)
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_no_first_party_import_inside_a_function():
    inside = []
    for p in (ROOT / LIBRARY).rglob("*.py"):
        for fn in ast.walk(ast.parse(p.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside += [f"{p.relative_to(ROOT)}:{n.lineno} ({fn.name})" for n in ast.walk(fn)
                           if isinstance(n, (ast.Import, ast.ImportFrom)) and any(imported(n, library_modules()))]
    assert not inside, "first-party imports inside functions (move the code instead):\n" + "\n".join(inside)


def contract_reaches_into(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} imports {b}" for a, targets in graph.items() if a.startswith("asyncpp.reference.")
                  for b in targets if b.startswith("asyncpp.pipeline."))


def test_the_contract_imports_nothing_of_the_pipeline():
    """reference/ is the contract every pipeline is tested against (the simulator): it shares the mathematics with
    the pipeline through core/ (core/masters.py, core/transfer.py), never through pipeline/ itself."""
    bad = contract_reaches_into(import_graph())
    assert not bad, "move what both need below the pipeline (core/):\n" + "\n".join(bad)
    assert contract_reaches_into({"asyncpp.reference.simulator": {"asyncpp.pipeline.weights"}})  # the check can fail


def test_pretrain_is_imported_by_nobody():
    """The entry script is hydra's app and the exit codes; tests, tools, bench and launch use asyncpp.job."""
    importers = []
    for top in ("asyncpp", "model_zoo", "data", "launch", "tools", "bench", "tests"):
        for p in (ROOT / top).rglob("*.py"):
            for n in ast.walk(ast.parse(p.read_text())):
                if isinstance(n, ast.Import) and any(a.name == "pretrain" for a in n.names) or (
                        isinstance(n, ast.ImportFrom) and n.module == "pretrain"):
                    importers.append(str(p.relative_to(ROOT)))
    assert not importers, f"these import pretrain.py; import asyncpp.job instead: {sorted(set(importers))}"


@pytest.mark.parametrize("bad", [
    ("asyncpp.config", "asyncpp.train.metrics"),     # a lower layer reaching up
    ("asyncpp.parallel.tp", "asyncpp.core.loss"),
])
def test_the_order_catches_an_upward_import(bad):
    """The check can fail: the kinds of edge the last restructure removed are upward by LAYERS."""
    a, b = bad
    assert layer_of(b) > layer_of(a)


def test_only_type_checking_imports_are_left_out_of_the_cycle_check():
    """The exemption is narrow: the config sections' annotation import is an edge of the full graph, not of the
    runtime one, and the runtime graph keeps run.py's real imports of the sections."""
    full, runtime = import_graph(), import_graph(at_runtime=True)
    assert "asyncpp.config.run" in full["asyncpp.config.parallel"]
    assert "asyncpp.config.run" not in runtime["asyncpp.config.parallel"]
    assert "asyncpp.config.parallel" in runtime["asyncpp.config.run"]


def test_the_cycle_check_catches_a_cycle():
    assert [sorted(c) for c in strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) if len(c) > 1] == [["a", "b"]]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of `graph` (edges to nodes outside it are ignored)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out
