"""What a launcher and a run share: the run's name (and so its directory), independent of the clock, so
rerunning the same command resumes it; and how a deliberate exit (a config error, a divergence, a
checkpointed stop) is told apart from a crash.

Megatron's `--save/--load` and torchtitan's `checkpoint.folder` make the checkpoint directory part of the
command; here it is derived from it. The name is `logging.run_name` if given, else the command's hydra
overrides that change what is trained (sorted, made filename-safe, shortened with a hash past
MAX_NAME characters), or "default" with none. pretrain.py's config puts a run in `outputs/<name>` and
every job of a sweep in `multirun/<run_name or "sweep">/<its own name>`; launch.slurm uses the same
name. Imports neither torch nor hydra: launch/ calls it on a login node.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

EXIT_CONFIG_ERROR = 2
"""pretrain.py's exit code for a ConfigError (found before any process group): never retried."""
EXIT_DIVERGED = 3
"""pretrain.py's exit code for a run that diverged (a non-finite update, max_consecutive_skips, a non-finite final
loss): not a crash (1) a restart would cure, nor a config error; its last checkpoint is still a good one."""
EXIT_CRASHED = 1
"""pretrain.py's exit code when a rank failed (asyncpp/parallel/failfast.py): a crash, which a launcher retries
(the rerun resumes from the newest complete checkpoint); the exit file names the rank, step, action and error."""
EXIT_NO_SPACE = 4
"""pretrain.py's exit code when the checkpoint directory's disk filled up during a save (checkpoint.NoSpaceLeft):
not retried, since a restart would write into the same full disk; the newest complete checkpoint is intact."""
EXIT_STOPPED = 143
"""128 + SIGTERM: the run was asked to stop (a signal) and checkpointed; rerunning the command resumes it."""
EXIT_FILE_ENV = "ASYNCPP_EXIT_FILE"
"""Set by launch.local: when pretrain.py exits on purpose (EXIT_CONFIG_ERROR, EXIT_DIVERGED, EXIT_NO_SPACE,
EXIT_STOPPED) or after a rank failed (EXIT_CRASHED: the first failing rank's record) it leaves "<code> <message>"
there. torchrun reports 1 whatever its ranks' codes were (and re-raises a SIGTERM it
forwarded), so this file is how the launcher tells a deliberate exit from a crash: only a crash is retried."""


def record_exit(code: int, message: str, path: str | None = None) -> None:
    """Leave `code` and `message` for the launcher at `path` (default: $ASYNCPP_EXIT_FILE; no-op without one).
    Every rank may write it; they write the same line, each through its own temporary file and a rename."""
    path = path or os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{code} {message}\n")
        os.replace(tmp, path)
    except OSError as e:  # the exit code itself still says it: a traceback here would turn exit 2 into 1
        print(f"warning: ${EXIT_FILE_ENV}={path} could not be written ({e.strerror or e}); the launcher sees only "
              f"the exit code {code}. Point ${EXIT_FILE_ENV} at a writable file", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_exit(path: str | Path) -> tuple[int, str] | None:
    """(code, message) that pretrain.py left at `path`, or None (nothing there: a crash, or a clean end)."""
    path = Path(path)
    if not path.exists():
        return None
    code, _, message = path.read_text().strip().partition(" ")
    return int(code), message


DEFAULT_NAME = "default"
MAX_NAME = 120

# Overrides that say how or where a run goes, not what it trains: they leave the name alone, so the
# same run can be resumed from another device, with another checkpoint cadence or another logger.
# train.steps is how far a run goes, not which run it is (Megatron's --train-iters beside a fixed --save): the same
# command with a larger train.steps continues the run in its directory (its checkpoints, metrics, data order).
# Inside a sweep it still names each job (SWEEP_ONLY), so that `-m train.steps=100,200` gives two directories.
NEUTRAL = ("hydra.", "logging.", "out_dir", "dry_run", "dry_run_trace", "dry_run_trace_microbatches", "dry_run_stage", "checkpoint.resume",
           "checkpoint.every", "checkpoint.keep_last", "checkpoint.async_save", "checkpoint.enabled", "train.device",
           "train.timeout_s", "train.compile", "train.allow_oversubscribe", "train.steps")
SWEEP_ONLY = ("train.steps",)
_SAFE = re.compile(r"[^A-Za-z0-9_.,=+@-]")


def _key(override: str) -> str:
    """The dotted key of an override: `+a/b=c` -> `a.b` (a config group is a key like any other)."""
    return override.split("=", 1)[0].lstrip("+~").replace("/", ".")


def is_neutral(override: str, sweep: bool = False) -> bool:
    key = _key(override)
    if sweep and key in SWEEP_ONLY:
        return False
    return any(key == n.rstrip(".") or n.endswith(".") and key.startswith(n) for n in NEUTRAL)


def derived_name(overrides: Iterable[str], sweep: bool = False) -> str:
    """The name of a run whose command line has these hydra overrides (order does not matter); `sweep`: of one
    job of a sweep (SWEEP_ONLY keys then count)."""
    kept = sorted(str(o) for o in overrides if not is_neutral(str(o), sweep))
    if not kept:
        return DEFAULT_NAME
    name = _SAFE.sub("_", ",".join(kept)).strip(".")
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(",".join(kept).encode()).hexdigest()[:12]
        name = f"{name[: MAX_NAME - 13]}-{digest}"
    return name


def explicit_name(overrides: Iterable[str]) -> str | None:
    """The value of a `logging.run_name=...` override (quotes removed), if there is one."""
    for o in overrides:
        if _key(o) == "logging.run_name" and "=" in o:
            return o.split("=", 1)[1].strip("'\"")
    return None


def _unset(explicit: str | None) -> bool:
    return explicit is None or str(explicit).strip() in ("", "None", "null")


def run_name(explicit: str | None, overrides: Iterable[str] = (), sweep: bool = False) -> str:
    """`explicit` (logging.run_name) made one safe directory name ("sync vs 2bw" -> "sync_vs_2bw"), or,
    when it is unset, derived_name(overrides, sweep)."""
    if _unset(explicit):
        return derived_name(overrides, sweep)
    return _SAFE.sub("_", str(explicit).strip()).strip(".") or DEFAULT_NAME


def sweep_name(explicit: str | None) -> str:
    """The directory of a sweep: logging.run_name, else 'sweep' (each job then gets its derived name)."""
    return "sweep" if _unset(explicit) else run_name(explicit)


def register_resolvers() -> None:
    """${asyncpp.run_name:<logging.run_name>,<hydra.overrides.task>}, ${asyncpp.job_name:...} (one job of a sweep)
    and ${asyncpp.sweep_name:<run_name>} for configs/pretrain.yaml. Call before hydra composes the config;
    idempotent."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("asyncpp.run_name", lambda explicit, overrides=(): run_name(explicit, overrides),
                                    replace=True)
    OmegaConf.register_new_resolver("asyncpp.job_name",
                                    lambda explicit, overrides=(): run_name(explicit, overrides, sweep=True),
                                    replace=True)
    OmegaConf.register_new_resolver("asyncpp.sweep_name", sweep_name, replace=True)
