"""What a launcher and a run share: the run's name (and so its directory), independent of the clock, so
rerunning the same command resumes it; and how a config error is told apart from a crash.

Megatron's `--save/--load` and torchtitan's `checkpoint.folder` make the checkpoint directory part of the
command; here it is derived from it. The name is `logging.run_name` if given, else the command's hydra
overrides that change what is trained (sorted, made filename-safe, shortened with a hash past
MAX_NAME characters), or "default" with none. pretrain.py's config puts a run in `outputs/<name>` and
every job of a sweep in `multirun/<run_name or "sweep">/<its own name>`; launch.slurm uses the same
name. Imports neither torch nor hydra: launch/ calls it on a login node.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

EXIT_CONFIG_ERROR = 2
"""pretrain.py's exit code for a ConfigError (found before any process group): launch.local never retries it."""
CONFIG_ERROR_FILE_ENV = "ASYNCPP_CONFIG_ERROR_FILE"
"""Set by launch.local: pretrain.py writes a config error's message there, so the launcher can tell it from
a crash (torchrun exits 1 whatever its ranks' exit codes were)."""

DEFAULT_NAME = "default"
MAX_NAME = 120

# Overrides that say how or where a run goes, not what it trains: they leave the name alone, so the
# same run can be resumed from another device, with another checkpoint cadence or another logger.
NEUTRAL = ("hydra.", "logging.", "out_dir", "dry_run", "checkpoint.resume", "checkpoint.every",
           "checkpoint.keep_last", "checkpoint.async_save", "checkpoint.enabled", "train.device",
           "train.timeout_s", "train.compile")
_SAFE = re.compile(r"[^A-Za-z0-9_.,=+@-]")


def _key(override: str) -> str:
    """The dotted key of an override: `+a/b=c` -> `a.b` (a config group is a key like any other)."""
    return override.split("=", 1)[0].lstrip("+~").replace("/", ".")


def is_neutral(override: str) -> bool:
    key = _key(override)
    return any(key == n.rstrip(".") or n.endswith(".") and key.startswith(n) for n in NEUTRAL)


def derived_name(overrides: Iterable[str]) -> str:
    """The name of a run whose command line has these hydra overrides (order does not matter)."""
    kept = sorted(str(o) for o in overrides if not is_neutral(str(o)))
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


def run_name(explicit: str | None, overrides: Iterable[str] = ()) -> str:
    """`explicit` (logging.run_name) made one safe directory name ("sync vs 2bw" -> "sync_vs_2bw"), or,
    when it is unset, derived_name(overrides)."""
    if _unset(explicit):
        return derived_name(overrides)
    return _SAFE.sub("_", str(explicit).strip()).strip(".") or DEFAULT_NAME


def sweep_name(explicit: str | None) -> str:
    """The directory of a sweep: logging.run_name, else 'sweep' (each job then gets its derived name)."""
    return "sweep" if _unset(explicit) else run_name(explicit)


def register_resolvers() -> None:
    """${asyncpp.run_name:<logging.run_name>,<hydra.overrides.task>} and ${asyncpp.sweep_name:<run_name>}
    for configs/pretrain.yaml. Call before hydra composes the config; idempotent."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("asyncpp.run_name", lambda explicit, overrides=(): run_name(explicit, overrides),
                                    replace=True)
    OmegaConf.register_new_resolver("asyncpp.sweep_name", sweep_name, replace=True)
