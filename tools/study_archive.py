"""A study's finished runs kept in git: the small files the report and the skip-finished logic read.

    python -m tools.study archive --out /root/asyncpp-study --to docs/reproduction/runs    # after runs finish
    python -m tools.study restore --out /root/asyncpp-study --from docs/reproduction/runs  # on a fresh machine

The study directory lives outside the work tree (it holds checkpoints, hundreds of MiB); the archive holds,
for each finished run, config.json, summary.json, study_status.json and metrics.jsonl (gzipped, byte-stable:
archiving an unchanged run rewrites the same bytes), plus the study's study.json. Restoring copies them back,
so tools.study counts those runs as done and tools.report reads them as if they had run there.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

SMALL_FILES = ("config.json", "summary.json", "study_status.json")
METRICS = "metrics.jsonl"
MANIFEST = "study.json"


class ArchiveError(ValueError):
    """The archive and the study directory disagree; the message names the run and the fix."""


def archive(out: Path, dest: Path, done: list[str]) -> list[str]:
    """Copy the `done` runs of `out` (names) and its study.json into `dest`. Returns the names copied."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out / MANIFEST, dest / MANIFEST)
    for name in done:
        src, dst = out / name, dest / name
        dst.mkdir(exist_ok=True)
        for f in SMALL_FILES:
            shutil.copyfile(src / f, dst / f)
        # mtime=0 and no file name in the header: the same metrics give the same bytes, so git sees no change
        with open(dst / (METRICS + ".gz"), "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                                     mtime=0) as gz:
            gz.write((src / METRICS).read_bytes())
    return list(done)


def restore(src: Path, out: Path) -> tuple[list[str], list[str]]:
    """Copy every archived run of `src` into `out` unless `out` already holds its finished summary.
    Returns (restored, already there). A run directory of `out` with another config.json stops it."""
    restored, kept = [], []
    out.mkdir(parents=True, exist_ok=True)
    for run in sorted(d for d in src.iterdir() if (d / "summary.json").is_file()):
        dst = out / run.name
        if (dst / "summary.json").is_file():
            kept.append(run.name)
            continue
        _check_same_config(run, dst)
        dst.mkdir(exist_ok=True)
        for f in SMALL_FILES:
            shutil.copyfile(run / f, dst / f)
        (dst / METRICS).write_bytes(gzip.decompress((run / (METRICS + ".gz")).read_bytes()))
        restored.append(run.name)
    _merge_manifest(src / MANIFEST, out / MANIFEST)
    return restored, kept


def _check_same_config(archived: Path, dst: Path) -> None:
    if not (dst / "config.json").is_file():
        return
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (archived, dst))
    ours.pop("out_dir", None), theirs.pop("out_dir", None)
    if ours != theirs:
        raise ArchiveError(f"{dst} holds an unfinished run of another config than {archived}; restore into "
                           "another --out, or remove that run directory")


def _merge_manifest(archived: Path, current: Path) -> None:
    """The study's study.json: the archive's if `out` has none; else `out`'s with the archive's invocations
    (the commands that made the restored runs) added before its own."""
    if not archived.is_file():
        return
    if not current.is_file():
        shutil.copyfile(archived, current)
        return
    old, now = json.loads(archived.read_text()), json.loads(current.read_text())
    seen = {(i["command"], i["time"]) for i in now.get("invocations", [])}
    now["invocations"] = [i for i in old.get("invocations", []) if (i["command"], i["time"]) not in seen] + \
        now.get("invocations", [])
    current.write_text(json.dumps(now, indent=1))
