"""The commands that README.md and docs/*.md show, extracted so a test can run them (they must not rot).

The marked set: every line of a ```bash fenced block that runs `pretrain.py` (plain, `-m` sweeps, under
torchrun) or `launch.slurm` / `launch.local`, with `\\` continuations joined and `# comments` dropped. A
pretrain command becomes one or more `DocCommand`s: a sweep (`-m a=x,y b=z,w`) expands to its points, as
hydra's basic sweeper would; torchrun's `--nproc_per_node` x `--nnodes` is the world size the config is
resolved at.

    python -m tests.docs_commands          # list them with where they come from
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass
class DocCommand:
    source: str
    """file:line of the command."""
    line: str
    """The command as written (continuations joined, comment dropped)."""
    kind: str
    """'pretrain', 'launch.slurm' or 'launch.local'."""
    overrides: list[str] = field(default_factory=list)
    """pretrain: the hydra overrides of this point (a sweep's point); launchers: their argv."""
    world_size: int = 1
    sweep: bool = False

    @property
    def id(self) -> str:
        return f"{self.source}: {' '.join(self.overrides) or '(defaults)'}"


def _lines(text: str, path: Path) -> list[tuple[int, str]]:
    """(line number, joined command) of each command line in the bash blocks of `text`."""
    out = []
    for block in _FENCE.finditer(text):
        first = text[: block.start(1)].count("\n") + 1
        pending, start = "", 0
        for i, raw in enumerate(block.group(1).splitlines()):
            line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
            if not pending:
                start = first + i
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            command = (pending + line).strip()
            pending = ""
            if command:
                out.append((start, command))
    return out


def _sweep_points(overrides: list[str]) -> list[list[str]]:
    """hydra's basic sweeper: `key=a,b` is a list of choices (a value in brackets is one list value)."""
    axes = []
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and "," in value and not value.startswith("[") and not key.startswith("hydra"):
            axes.append([f"{key}={v}" for v in value.split(",")])
        else:
            axes.append([o])
    return [list(point) for point in itertools.product(*axes)]


def _pretrain(source: str, line: str, words: list[str]) -> list[DocCommand]:
    entry = words.index("pretrain.py")
    launcher, args = words[:entry], [w for w in words[entry + 1:] if w != "..."]
    world = 1
    for w in launcher:
        for name in ("--nproc_per_node", "--nproc-per-node", "--nnodes"):
            if w.startswith(name + "="):
                world *= int(w.split("=", 1)[1])
    sweep = "-m" in args or "--multirun" in args
    args = [a for a in args if a not in ("-m", "--multirun")]
    points = _sweep_points(args) if sweep else [args]
    return [DocCommand(source, line, "pretrain", p, world, sweep) for p in points]


def doc_commands() -> list[DocCommand]:
    commands = []
    for path in DOCS:
        for lineno, line in _lines(path.read_text(), path):
            words = shlex.split(line)
            source = f"{path.relative_to(ROOT)}:{lineno}"
            if "pretrain.py" in words:
                commands += _pretrain(source, line, words)
            for kind in ("launch.slurm", "launch.local"):
                if kind in words:
                    commands.append(DocCommand(source, line, kind, words[words.index(kind) + 1:]))
    return commands


if __name__ == "__main__":
    for c in doc_commands():
        print(f"{c.source:24} {c.kind:13} world={c.world_size:<3} {' '.join(c.overrides)}")
