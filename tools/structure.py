"""The structure figures of issue 42, computed from the source (so a before and an after are measured alike).

    python tools/structure.py [--root DIR] [--json OUT]

Prints one table: the lines of StageEngine and PipelineExecutor and their `is not None` tests; the call sites of
run_vocab_split; the functions that compute a cross entropy (a call of torch's, or a definition named for one);
the public signatures whose cfg / model_cfg / optimizer parameter carries no type; the longest function and the
largest class. Library code only (asyncpp/, model_zoo/, data/): tests and tools are left out.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

PACKAGES = ("asyncpp", "model_zoo", "data")
CENTRAL = {"StageEngine": "asyncpp/pipeline/engine.py", "PipelineExecutor": "asyncpp/pipeline/executor.py"}
UNTYPED = ("cfg", "model_cfg", "optimizer")
LOSS_NAMES = ("cross_entropy", "mean_loss")


def modules(root: Path) -> dict[str, ast.Module]:
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            out[rel] = ast.parse(path.read_text(), rel)
    return out


def span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def class_figures(root: Path, trees: dict[str, ast.Module]) -> dict[str, dict]:
    out = {}
    for name, rel in CENTRAL.items():
        node = next(n for n in ast.walk(trees[rel]) if isinstance(n, ast.ClassDef) and n.name == name)
        lines = (root / rel).read_text().splitlines()[node.lineno - 1:node.end_lineno]
        out[name] = {"lines": span(node), "is_not_none": sum(line.count("is not None") for line in lines)}
    return out


def called_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def functions(tree: ast.Module):
    """(qualified name, node) of every function, methods as Class.method."""
    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
    yield from visit(tree, "")


def call_sites(trees: dict[str, ast.Module], callee: str) -> list[str]:
    out = []
    for rel, tree in trees.items():
        for qual, fn in functions(tree):
            inner = {id(n) for c in ast.walk(fn) if c is not fn and isinstance(c, (ast.FunctionDef, ast.Lambda))
                     for n in ast.walk(c)}  # a nested function's calls are its own
            for n in ast.walk(fn):
                if isinstance(n, ast.Call) and called_name(n) == callee and id(n) not in inner:
                    out.append(f"{rel}:{n.lineno} ({qual})")
    return sorted(set(out))


def torch_cross_entropy(call: ast.Call) -> bool:
    """F.cross_entropy / nn.functional.cross_entropy / torch.nn.functional.cross_entropy."""
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr == "cross_entropy" and ast.unparse(f.value) in (
        "F", "nn.functional", "torch.nn.functional")


def cross_entropies(trees: dict[str, ast.Module]) -> list[str]:
    """Functions that compute a cross entropy: they call torch's, or are named for one (a `mean_loss` only when it
    takes a logarithm itself: a mean of losses is not one)."""
    out = []
    for rel, tree in trees.items():
        for qual, fn in functions(tree):
            own = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and torch_cross_entropy(n)]
            logs = any(isinstance(n, ast.Call) and called_name(n) in ("log", "logsumexp", "log_softmax")
                       for n in ast.walk(fn))
            named = any(k in fn.name for k in LOSS_NAMES) and (logs or "cross_entropy" in fn.name)
            if own or named:
                out.append(f"{rel}:{fn.lineno} {qual}" + (" (torch's)" if own else ""))
    return out


def untyped(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name in UNTYPED}
    for rel, tree in trees.items():
        for qual, fn in functions(tree):
            args = fn.args
            for a in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                if a.arg in out and a.annotation is None:
                    out[a.arg].append(f"{rel}:{fn.lineno} {qual}")
    return out


def largest(trees: dict[str, ast.Module]) -> tuple[str, int, str, int]:
    fn_best, cls_best = ("", 0), ("", 0)
    for rel, tree in trees.items():
        for qual, fn in functions(tree):
            if span(fn) > fn_best[1]:
                fn_best = (f"{rel}:{fn.lineno} {qual}", span(fn))
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and span(n) > cls_best[1]:
                cls_best = (f"{rel}:{n.lineno} {n.name}", span(n))
    return (*fn_best, *cls_best)


def measure(root: Path) -> dict:
    trees = modules(root)
    fn, fn_lines, cls, cls_lines = largest(trees)
    return {"classes": class_figures(root, trees), "run_vocab_split": call_sites(trees, "run_vocab_split"),
            "cross_entropy": cross_entropies(trees), "untyped": untyped(trees),
            "longest_function": [fn, fn_lines], "largest_class": [cls, cls_lines]}


def table(m: dict) -> str:
    rows = [(f"{name} lines / `is not None`", f"{c['lines']} / {c['is_not_none']}") for name, c in m["classes"].items()]
    rows += [("run_vocab_split call sites", str(len(m["run_vocab_split"]))),
             ("cross-entropy implementations", str(len(m["cross_entropy"])))]
    rows += [(f"untyped `{k}` parameters", str(len(v))) for k, v in m["untyped"].items()]
    rows += [("longest function", f"{m['longest_function'][1]} lines: {m['longest_function'][0]}"),
             ("largest class", f"{m['largest_class'][1]} lines: {m['largest_class'][0]}")]
    width = max(len(r[0]) for r in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += ["", "run_vocab_split:", *(f"  {s}" for s in m["run_vocab_split"]),
              "cross entropy:", *(f"  {s}" for s in m["cross_entropy"])]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    m = measure(args.root)
    print(table(m))
    if args.json is not None:
        args.json.write_text(json.dumps(m, indent=1))


if __name__ == "__main__":
    main()
