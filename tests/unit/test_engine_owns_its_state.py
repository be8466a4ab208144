"""The engine's step state (its microbatch losses, the update's step records) changes only through its own
methods: no other class pops, clears or writes `engine.losses` / `engine.records` (issue 34: one home)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTATORS = {"pop", "clear", "setdefault", "update", "popitem", "append"}


def mutations(tree: ast.AST) -> list[int]:
    """Lines where `<...>.engine.losses` or `<...>.engine.records` is mutated (a mutating call, an item
    assignment or a del)."""
    def engine_dict(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in ("losses", "records")
                and isinstance(node.value, ast.Attribute) and node.value.attr == "engine")

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS \
                and engine_dict(n.func.value):
            found.append(n.lineno)
        targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else []
        found += [n.lineno for t in targets if isinstance(t, ast.Subscript) and engine_dict(t.value)]
    return sorted(found)


def test_no_class_mutates_the_engines_dicts():
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in sorted((ROOT / "asyncpp").rglob("*.py"))
           for line in mutations(ast.parse(p.read_text()))]
    assert not bad, "mutate the engine's state through its methods (take_record, drop_losses):\n" + "\n".join(bad)


def test_the_check_finds_a_mutation():
    tree = ast.parse("self.engine.losses.clear()\nrec = x.engine.records.pop(3)\ndel self.engine.records[2]\n"
                     "self.engine.losses[1] = []\nself.losses.clear()\n")
    assert mutations(tree) == [1, 2, 3, 4]
