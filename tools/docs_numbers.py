"""The numbers README.md and docs/*.md quote that the code can compute, computed (issue 47: docs whose numbers drift).

In a document a computed number sits between markers, invisible once rendered:

    smollm2_135m <!-- n:recipe_memory.smollm2_135m -->14.05 GiB<!-- /n -->

Each name has one function below. "cheap" ones (parameter counts on the meta device: seconds) are recomputed by the
default test; "slow" ones (a recipe's dry run, the collection of the default suite: minutes on a loaded 2-core
machine) are cached in docs/numbers.json, which the default test reads and a `slow` test recomputes.

    python -m tools.docs_numbers            # recompute the cheap numbers, take the slow ones from the cache, rewrite
    python -m tools.docs_numbers --all      # recompute every number (minutes), update the cache, rewrite
    python -m tools.docs_numbers --check    # compare only: exit 1 listing every number that differs
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from asyncpp import job
from asyncpp.train.checkpoint.size import checkpoint_size
from model_zoo.counting import count_parameters
from model_zoo.registry import get_model_config

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "docs" / "numbers.json"
GIB = 2**30
MARKER = re.compile(r"<!-- n:(?P<name>[\w.]+) -->(?P<value>.*?)<!-- /n -->")

#: plan name: (recipe, world size, extra overrides) (tests/unit/test_paper_recipes.py's RECIPES; docs/recipes.md's
#: and the README's commands)
RECIPE_PLANS = {"smollm2_135m": ("smollm2_135m", 1, ()), "smollm2_360m": ("smollm2_360m", 1, ()),
                "moe_2b": ("moe_2b", 8, ()), "hybrid_moe_10b": ("hybrid_moe_10b", 8, ()),
                "hybrid_moe_10b_32gpu": ("hybrid_moe_10b", 32, ("parallel=hybrid_moe_10b_32gpu",))}


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _count(n: float, unit: str) -> str:
    return f"{n / 1e9:.2f}B" if unit == "B" else f"{n / 1e6:.1f}M"


def params(model: str) -> str:
    """Total (/ active, for an MoE model) parameters: model_zoo.counting's convention (a tie counted once)."""
    c = count_parameters(get_model_config(model))
    unit = "B" if c.total >= 1e9 else "M"
    return _count(c.total, unit) if c.total == c.active else f"{_count(c.total, unit)} / {_count(c.active, unit)}"


def _dry_run_overrides(plan: str, *more: str) -> list[str]:
    """The recipe's dry run at its world size (docs/recipes.md's command), as hydra overrides."""
    recipe, world, extra = RECIPE_PLANS[plan]
    return [f"+experiment=paper/{recipe}", *extra, "data=default", "logging=disabled", f"dry_run={world}", *more]


def recipe_memory(plan: str) -> str:
    """The largest rank of the recipe's dry run at its world size (docs/recipes.md's command), GiB."""
    cfg, model_cfg = job.resolve(job.compose(_dry_run_overrides(plan, "out_dir=/tmp/asyncpp-docs-numbers")))
    reports = job.run_dry(cfg, model_cfg, echo=lambda text: None)
    return f"{max(r['memory']['total_bytes'] for r in reports) / GIB:.2f} GiB"


def recipe_checkpoint(recipe: str) -> str:
    """One checkpoint of the recipe (every rank's share together; asyncpp/train/checkpoint/size.py), GiB, by part."""
    _, world, extra = RECIPE_PLANS[recipe]
    cfg, model_cfg = job.resolve(job.compose([f"+experiment=paper/{recipe}", *extra, "data=default",
                                              "logging=disabled"]), world_size=world)
    s = checkpoint_size(cfg, model_cfg)
    parts = [f"x_t {s.newest / GIB:.2f}", f"older versions {s.older / GIB:.2f}", f"EF {s.error_feedback / GIB:.2f}",
             f"optimizer {s.optimizer / GIB:.2f}"]
    return f"{s.total / GIB:.2f} GiB ({', '.join(parts)})"


def default_suite_tests() -> str:
    """The default suite's test count (pytest's addopts: not slow, gpu or slurm), to the nearest 50 (a few tests
    more or fewer do not make the docs stale)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, check=False).stdout
    found = re.search(r"(\d+)(?:/\d+)? tests? collected", out) or re.search(r"(\d+) tests? selected", out)
    if found is None:
        raise RuntimeError(f"pytest --collect-only printed no count; its last lines:\n{out[-2000:]}")
    return f"{round(int(found.group(1)) / 50) * 50:,}"


def recipe_gpu_hours(recipe: str) -> str:
    """The recipe's token budget in GPU-hours on an H100 and an H200 by the step-time model: every stage traced at
    real size on meta tensors (`dry_run_trace=true`, analysis/stagetime.py), tokens / (tokens/s per GPU); the job's
    wall time is that / GPUs."""
    world = RECIPE_PLANS[recipe][1]
    out = Path("/tmp/asyncpp-docs-numbers") / f"trace-{recipe}"
    # P microbatches per traced step (the step predicted at the recipe's m): the MoE recipes' 64 and 128 take hours.
    cfg, model_cfg = job.resolve(job.compose(_dry_run_overrides(recipe, "dry_run_trace=true", f"out_dir={out}",
                                                                "dry_run_trace_microbatches=${parallel.pp}")))
    job.run_dry(cfg, model_cfg, echo=lambda text: None)
    devices = json.loads((out / "dry_run_trace.json").read_text())["prediction"]["devices"]
    parts = []
    for name in ("H100", "H200"):
        run = devices[name]["job"]
        # tokens_per_step is the job's (every replica's), so this is GPU-hours; the job takes them / world of wall time.
        gpu_hours = cfg.train.steps * run["tokens_per_step"] / run["tokens_per_s_per_gpu"] / 3600
        wall = f", {gpu_hours / world:,.1f} h on {world} GPUs" if world > 1 else ""
        parts.append(f"{name} {gpu_hours:,.1f}{wall} ({run['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                     f"MFU {run['mfu']:.1%})")
    return "; ".join(parts)


@dataclass(frozen=True)
class Number:
    name: str
    compute: Callable[[], str]
    slow: bool


def numbers() -> dict[str, Number]:
    found = [Number(f"params.{m}", lambda m=m: params(m), slow=False)
             for m in ("smollm2_135m", "smollm2_360m", "moe_2b", "hybrid_moe_10b", "tiny_dense", "tiny_moe", "tiny_hybrid")]
    found += [Number(f"recipe_memory.{r}", lambda r=r: recipe_memory(r), slow=True) for r in RECIPE_PLANS]
    found += [Number(f"recipe_checkpoint.{r}", lambda r=r: recipe_checkpoint(r), slow=True)
              for r in ("smollm2_135m", "smollm2_360m", "moe_2b", "hybrid_moe_10b")]
    found += [Number(f"recipe_gpu_hours.{r}", lambda r=r: recipe_gpu_hours(r), slow=True) for r in RECIPE_PLANS]
    found.append(Number("default_suite_tests", default_suite_tests, slow=True))
    return {n.name: n for n in found}


def compute(slow: bool, cache: dict[str, str]) -> dict[str, str]:
    """Every number: the cheap ones computed, the slow ones computed only with `slow` (else from `cache`)."""
    return {name: n.compute() if slow or not n.slow else cache[name] for name, n in numbers().items()}


def differences(docs: Iterable[Path], values: dict[str, str]) -> list[str]:
    """One line per marked number that is not its generated value (or whose name no function computes)."""
    out = []
    for path in docs:
        text = path.read_text()
        for mark in MARKER.finditer(text):
            line = text.count("\n", 0, mark.start()) + 1
            name, held = mark["name"], mark["value"]
            if name not in values:
                out.append(f"{path.name}:{line}: {name} is computed by nothing in tools/docs_numbers.py")
            elif held != values[name]:
                out.append(f"{path.name}:{line}: {name} reads {held!r}, the code computes {values[name]!r}; "
                           "run python -m tools.docs_numbers")
    return out


def rewrite(docs: Iterable[Path], values: dict[str, str]) -> list[Path]:
    """Put each generated value between its markers; returns the documents changed."""
    changed = []
    for path in docs:
        text = path.read_text()
        new = MARKER.sub(lambda m: f"<!-- n:{m['name']} -->{values.get(m['name'], m['value'])}<!-- /n -->", text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="recompute the slow numbers too (minutes) and update the cache")
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 if a document differs")
    args = ap.parse_args(argv)
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    values = compute(args.all, cache)
    if args.check:
        diff = differences(documents(), values)
        print("\n".join(diff) or "every marked number is the generated one")
        return 1 if diff else 0
    if args.all:
        CACHE.write_text(json.dumps({k: values[k] for k, n in numbers().items() if n.slow}, indent=1) + "\n")
    for path in rewrite(documents(), values):
        print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
