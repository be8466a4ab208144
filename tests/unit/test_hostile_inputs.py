"""A hostile user loses nothing (issue 29): a corpus of bad and odd inputs across config, data, checkpoints,
environment, launchers and tools. Each case is either run correctly or refused with exit code 2 (a ConfigError,
or a tool's/launcher's exit 2) before any process group or model exists, naming the field; never a traceback.
Every case that could lose work also checks that every file that was there before is byte-identical after.

Most cases go in-process through what pretrain.py's main does first: `job.compose` + `job.resolve` +
`preflight.check` (cheap: no model, no process group). Cases that must show a run really continues (a fallback
to an intact checkpoint, a resume in a directory of its own) also train (tiny_dense, a few steps, in-process);
a few go through a subprocess (exit codes of pretrain.py and the launchers).

Each outcome gets one of the classes of issue 29's table (CLASSES). ASYNCPP_HOSTILE_REPORT=<file> writes every
case's class there as JSON (how the note's before/after table was made: the same file run on main's code).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from asyncpp import job
from asyncpp.config import ConfigError
from asyncpp.train import checkpoint as ckpt
from asyncpp.train import preflight
from launch import local, slurm
from tests.unit.test_preflight import write_prefix
from tools import hf

REPO = Path(__file__).resolve().parents[2]

CLEAR = "clear refusal or correct run"
LATE = "clear message, only after the model was built"
RAW = "raw traceback or unclear message"
SILENT = "accepted and silently wrong"
HANG = "hang (accepted; cannot fit)"
LOST = "work lost"
CLASSES = (CLEAR, LATE, RAW, SILENT, HANG, LOST)

BASE = ["model=tiny_dense", "schedule=sync", "optimizer=adamw", "train.steps=4", "train.seq_len=32",
        "train.micro_batch_size=2", "train.eval_every=0", "logging=disabled", "checkpoint.every=2",
        "checkpoint.every_minutes=0", "checkpoint.warn_loss_minutes=0"]


class Outcome(NamedTuple):
    cls: str
    detail: str


class Case(NamedTuple):
    id: str
    area: str
    """config, data, checkpoint, environment, launcher, tool."""
    run: Callable[..., Outcome]
    """(tmp directory, the base run's directory, full) -> its outcome; `full`: also train what the checks
    accept (the cases that train are run so under -m slow, test_hostile_input_trained)."""
    slow: bool = False
    """A subprocess (seconds of imports): under -m slow only."""


# ---- how a case is judged -----------------------------------------------------------------------
def _judge(expect: str, refused: str | None, raw: str | None, if_accepted: str) -> Outcome:
    """expect 'ok' (it must run) or the field the refusal must name."""
    if raw is not None:
        return Outcome(RAW, raw)
    if expect == "ok":
        return Outcome(CLEAR, "accepted") if refused is None else Outcome(RAW, f"refused a good input: {refused}")
    if refused is None:
        return Outcome(if_accepted, "accepted")
    return Outcome(CLEAR, refused) if expect in refused else Outcome(RAW, f"names no {expect!r}: {refused}")


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


APPENDED = ("metrics.jsonl", "pretrain.log")
"""A run that continues its history appends to these: what was there must stay, as a prefix."""
REWRITTEN = ("memory_plan.txt",)
"""Written anew by every start (job.MEMORY_PLAN_FILE: the memory plan of the layout running now, issue 47's quiet
console), so a resume at another microbatch shape replaces it: a report of the present, not work."""


def _lost(before: dict[str, str], root: Path, appended: dict[str, bytes] | None = None) -> list[str]:
    after = _snapshot(root)
    changed = [name for name, digest in before.items() if after.get(name) != digest and name not in REWRITTEN]
    appended = appended or {}
    return [n for n in changed if n not in appended or not (root / n).read_bytes().startswith(appended[n])]


def _resolve(overrides: list[str]):
    cfg, model_cfg = job.resolve(job.compose(overrides))
    said: list[str] = []
    preflight.check(cfg, model_cfg, warn=said.append)
    done = preflight.completed(cfg)  # as job.run: a finished run says so and exits 0 (pretrain.py)
    if done:
        raise preflight.RunComplete(done)
    return cfg, model_cfg, said


def _fill(items, tmp: Path, base: Path) -> list[str]:
    return [str(o).replace("{tmp}", str(tmp)).replace("{base}", str(base)) for o in items]


def config(*overrides: str, expect: str, if_accepted: str = SILENT, env: dict | None = None,
           setup: Callable[[Path], None] | None = None, base: bool = True) -> Callable[[Path, Path], Outcome]:
    """A command line's overrides, checked as pretrain.py's main checks them before building anything."""
    def run(tmp: Path, base_run: Path, full: bool = False) -> Outcome:
        if setup is not None:
            setup(tmp)
        items = [*(BASE if base else []), *_fill(overrides, tmp, base_run)]
        if not any(o.startswith("out_dir=") for o in items):
            items.append(f"out_dir={tmp / 'run'}")
        refused = raw = None
        with mock.patch.dict(os.environ, _fill_env(env, tmp)):
            try:
                _resolve(items)
            except (ConfigError, preflight.RunComplete) as e:
                refused = str(e)
            except Exception as e:  # noqa: BLE001 - a raw exception is what the corpus classifies
                raw = f"{type(e).__name__}: {e}"
        return _judge(expect, refused, raw, if_accepted)
    return run


def _fill_env(env: dict | None, tmp: Path) -> dict:
    return {k: v.replace("{tmp}", str(tmp)) for k, v in (env or {}).items()}


def resume(*overrides: str, expect: str, damage: Callable[[Path], None] | None = None, into: str = "run",
           train: bool = True, warns: str | None = None, if_accepted: str = SILENT,
           prepare: Callable[[Path], None] | None = None, continues: bool = False,
           expect_step: int | None = None) -> Callable[..., Outcome]:
    """Copies of the base run (4 steps, checkpoints at 2 and 4) at tmp/base and tmp/<into>, the one under tmp/base
    damaged by `damage`; then the overrides (with {base} = tmp/base) checked and, if accepted, trained. Every file
    of tmp/base must be byte-identical afterwards unless `damage` changed it on purpose (then the damaged
    checkpoint may be rewritten): else the case lost work. `continues`: the case resumes tmp/base's newest
    checkpoint, so its metrics and log may grow (what was there stays) and its summary and config.json are the
    continued run's. `warns`: what the accepted run must have said; `expect_step`: the step it must resume
    (preflight's choice and the run's own). With `full`, an accepted case also trains."""
    def run(tmp: Path, base_run: Path, full: bool = False) -> Outcome:
        copy = tmp / "base"
        shutil.copytree(base_run, copy)
        if damage is not None:
            damage(copy)
        if prepare is not None:
            prepare(copy)
        before = _snapshot(copy)
        appended = {n: (copy / n).read_bytes() for n in APPENDED} if continues else {}
        items = [*BASE, *_fill(overrides, tmp, copy)]
        if not any(o.startswith("out_dir=") for o in items):
            items.append(f"out_dir={copy if into == 'base' else tmp / into}")
        refused = raw = None
        said: list[str] = []
        try:
            cfg, model_cfg, said = _resolve(items)
        except (ConfigError, preflight.RunComplete) as e:  # a finished run's one line names train.steps
            refused = str(e)
        except Exception as e:  # noqa: BLE001
            raw = f"{type(e).__name__}: {e}"
        wrong_point = None
        if refused is None and raw is None and expect_step is not None:
            point = preflight.check_resume(cfg, warn=lambda text: None)
            runtime = ckpt.resume_point(cfg, None, warn=lambda text: None)
            if point is None or point[1] != expect_step or runtime != point:
                wrong_point = f"resumes {point} (the run itself: {runtime}), not step {expect_step}"
        if refused is None and raw is None and train and full:
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    job.run(cfg, model_cfg)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - it got past the checks and failed with
                # the model built (DCP's CheckpointException is a BaseException)
                clear = isinstance(e, ConfigError | ValueError | FileNotFoundError)
                return Outcome(LATE if clear else RAW, f"after the build: {type(e).__name__}: {e}")
        if wrong_point is not None:  # after the training: a run that fails on the model built is what it is
            return Outcome(SILENT, wrong_point)
        lost = _lost(before, copy, appended)
        if continues:
            lost = [n for n in lost if n not in ("summary.json", "config.json")]
        if damage is not None:  # a damaged checkpoint is garbage: redoing its steps is the fallback's job
            redone = ("checkpoints/step_00000004", "metrics.jsonl", "summary.json", "pretrain.log", "config.json")
            lost = [n for n in lost if not n.startswith(redone)]
        if lost:
            return Outcome(LOST, f"changed: {lost[:4]}")
        outcome = _judge(expect, refused, raw, if_accepted)
        if outcome.cls == CLEAR and refused is None and warns is not None and not any(warns in s for s in said):
            return Outcome(SILENT, f"accepted without saying {warns!r}: {said}")
        return outcome
    return run


def truncate(name: str, step: int = 4, keep: int = 10) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / "checkpoints" / f"step_{step:08d}" / name
        path.write_bytes(path.read_bytes()[:keep])
    return damage


def remove(name: str, step: int = 4) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        (run_dir / "checkpoints" / f"step_{step:08d}" / name).unlink()
    return damage


def rewrite_manifest(change: Callable[[dict], object], step: int = 4) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / "checkpoints" / f"step_{step:08d}" / "manifest.json"
        manifest = json.loads(path.read_text())
        path.write_text(json.dumps(change(manifest)))
    return damage


def _drop(key: str):
    def change(m: dict) -> dict:
        m.pop(key)
        return m
    return change


def _set(key: str, value):
    def change(m: dict) -> dict:
        m[key] = value
        return m
    return change


# ---- tools and launchers -------------------------------------------------------------------------
def _call(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's p.error: exit 2 and a usage line naming the option
            code = e.code if isinstance(e.code, int) else 1
        except Exception as e:  # noqa: BLE001
            return -1, f"{type(e).__name__}: {e}"
    return code, err.getvalue()


def tool(main: Callable[[list[str]], int], *argv: str, expect: str, guard: str | None = None,
         setup: Callable[[Path, Path], None] | None = None, if_accepted: str = SILENT) -> Callable[[Path, Path], Outcome]:
    """A tool's or launcher's main(argv) in-process: exit 0 (expect 'ok') or exit 2 naming `expect`. `guard`:
    a directory (under tmp) whose files must be byte-identical afterwards."""
    def run(tmp: Path, base_run: Path, full: bool = False) -> Outcome:
        if setup is not None:
            setup(tmp, base_run)
        before = _snapshot(tmp / guard) if guard else {}
        code, err = _call(main, _fill(argv, tmp, base_run))
        if guard and _lost(before, tmp / guard):
            return Outcome(LOST, f"changed: {_lost(before, tmp / guard)[:4]}")
        if code == -1 or "Traceback" in err:
            return Outcome(RAW, err[-500:])
        if code == 0:
            return _judge(expect, None, None, if_accepted)
        if code == 2:
            return _judge(expect, err.strip() or "(nothing said)", None, if_accepted)
        return Outcome(RAW, f"exit {code}: {err[-300:]}")
    return run


def run_dir_copy(tmp: Path, base_run: Path) -> None:
    shutil.copytree(base_run, tmp / "out")


def some_files(tmp: Path, base_run: Path) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("mine\n")
    (tmp / "out" / "config.json").write_text('{"mine": true}\n')


def a_file(tmp: Path, base_run: Path) -> None:
    (tmp / "out").write_text("a file\n")


def subprocess_case(args: list[str], expect: str, env: dict | None = None,
                    if_accepted: str = SILENT) -> Callable[[Path, Path], Outcome]:
    """pretrain.py (or a module) in a subprocess: exit 2, the field named on stderr, no traceback."""
    def run(tmp: Path, base_run: Path, full: bool = False) -> Outcome:
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **_fill_env(env, tmp)}
        proc = subprocess.run([sys.executable, *_fill(args, tmp, base_run)], check=False, cwd=REPO,
                              capture_output=True, text=True, env=full_env, timeout=300)
        if "Traceback" in proc.stderr:
            return Outcome(RAW, f"exit {proc.returncode}: {proc.stderr[-400:]}")
        if proc.returncode == 0:
            return _judge(expect, None, None, if_accepted)
        if proc.returncode == 2:
            return _judge(expect, proc.stderr.strip(), None, if_accepted)
        return Outcome(RAW, f"exit {proc.returncode}: {proc.stderr[-400:]}")
    return run


def _prefix(tmp: Path, name: str = "corpus", first: int = 1) -> Path:
    docs = [[first + (i * 7 + j) % 200 for j in range(40 + i % 9)] for i in range(64)]
    return write_prefix(tmp / name, docs)


def prefixes(tmp: Path) -> None:
    _prefix(tmp, "a")
    _prefix(tmp, "b")
    _prefix(tmp, "big", first=8100)  # token ids up to 8299, beyond tiny_dense's 8192-token vocabulary


def a_plain_file(name: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / name).write_text("a file, not a directory\n")
    return setup


IDX = ["data.name=indexed", f"data.tokenizer={REPO / 'data' / 'default_corpus' / 'tokenizer.json'}"]
SLURM = ["--nodes", "1", "--partition", "p", "--no-validate"]


def slurm_parse(argv: list[str]) -> int:
    slurm.parse_args(argv)
    return 0


# ---- the corpus ----------------------------------------------------------------------------------
def _cases() -> list[Case]:
    c: list[Case] = []

    def add(area: str, id_: str, run, slow: bool = False) -> None:
        c.append(Case(f"{area}:{id_}", area, run, slow))

    # -- model overrides: types against ModelConfig's fields
    for key, value, expect in [
        ("tie_embeddings", "no", "model.overrides.tie_embeddings"),
        ("tie_embeddings", "1", "model.overrides.tie_embeddings"),
        ("tie_embeddings", "'true'", "model.overrides.tie_embeddings"),
        ("qk_norm", "yes", "model.overrides.qk_norm"),
        ("num_layers", "two", "model.overrides.num_layers"),
        ("num_layers", "2.5", "model.overrides.num_layers"),
        ("num_layers", "true", "model.overrides.num_layers"),
        ("hidden_size", "'128'", "model.overrides.hidden_size"),
        ("rope_theta", "fast", "model.overrides.rope_theta"),
        ("norm_eps", "[1e-5]", "model.overrides.norm_eps"),
        ("layer_types", "attn", "model.overrides.layer_types"),
        ("init_std", "null", "model.overrides.init_std"),
        ("num_heads", "0", "num_heads"),
        ("vocab_size", "0", "vocab_size"),
        ("hidden_size", "-128", "hidden_size"),
        ("head_dim", "0", "head_dim"),
        ("bogus", "1", "bogus"),
    ]:
        add("config", f"override-{key}={value}", config(f"+model.overrides.{key}={value}", expect=expect))
    add("config", "override-moe-field-type", config("model=tiny_moe", "+model.overrides.moe.num_experts=many",
                                                    expect="model.overrides.moe.num_experts"))
    add("config", "override-moe-unknown", config("model=tiny_moe", "+model.overrides.moe.experts=4",
                                                 expect="experts"))
    add("config", "overrides-not-a-mapping", config("model.overrides=5", expect="model.overrides"))
    for good in ("+model.overrides.tie_embeddings=false", "+model.overrides.tie_embeddings=true",
                 "+model.overrides.num_layers=2", "+model.overrides.qk_norm=true", "+model.overrides.rope_theta=5e5",
                 "+model.overrides.layer_types=[attn,attn,attn,attn]"):
        add("config", f"good-{good}", config(good, expect="ok"))

    # -- integers and their ranges
    for override, expect in [
        ("seed=-1", "seed"), (f"seed={2**32}", "seed"), (f"seed={2**64}", "seed"), ("seed=1.5", "seed"),
        ("seed=true", "seed"), ("seed=abc", "seed"),
        ("parallel.pp=0", "parallel.pp"), ("parallel.pp=-2", "parallel.pp"), ("parallel.tp=0", "parallel.tp"),
        ("parallel.ep=0", "parallel.ep"), ("parallel.dp=-1", "parallel.dp"),
        ("train.steps=0", "train.steps"), ("train.steps=-5", "train.steps"), ("train.steps=1e3", "ok"),
        ("train.steps=2.5", "train.steps"), ("train.micro_batch_size=0", "train.micro_batch_size"),
        ("train.num_microbatches=0", "train.num_microbatches"), ("train.seq_len=0", "train.seq_len"),
        ("train.seq_len=100000", "train.seq_len"), ("train.eval_batches=0", "train.eval_batches"),
        ("train.eval_every=-1", "train.eval_every"), ("train.max_consecutive_skips=0", "train.max_consecutive_skips"),
        ("train.grad_clip=-1", "train.grad_clip"), ("train.timeout_s=0", "train.timeout_s"),
        ("train.peak_tflops=0", "train.peak_tflops"), ("train.host_mmap_threshold=-1", "train.host_mmap_threshold"),
        ("train.global_batch_size=7", "train.global_batch_size"), ("train.batch_rampup=[1,2]", "train.batch_rampup"),
        ("checkpoint.every=-1", "checkpoint.every"), ("checkpoint.keep_last=0", "checkpoint.keep_last"),
        ("checkpoint.every_minutes=-1", "checkpoint.every_minutes"), ("logging.log_every=0", "logging.log_every"),
        ("dry_run=-1", "dry_run"), ("staleness.sync_start_steps=-1", "staleness.sync_start_steps"),
        ("optimizer.schedule.warmup_steps=-1", "warmup_steps"), ("optimizer.schedule.warmup_steps=99", "warmup_steps"),
        ("optimizer.ns_steps=0", "optimizer.ns_steps"),
    ]:
        add("config", f"range-{override}", config(override, expect=expect))
    for override, expect in [
        ("optimizer.lr=0", "optimizer.lr"), ("optimizer.lr=-1", "optimizer.lr"), ("optimizer.lr=nan", "optimizer.lr"),
        ("optimizer.lr=inf", "optimizer.lr"), ("optimizer.lr=1e-3x", "optimizer.lr"),
        ("optimizer.betas=[0.9,1.0]", "optimizer.betas"), ("optimizer.betas=[0.9]", "optimizer.betas"),
        ("optimizer.eps=0", "optimizer.eps"), ("optimizer.weight_decay=-0.1", "optimizer.weight_decay"),
        ("optimizer.schedule.kind=linear", "optimizer.schedule.kind"),
        ("optimizer.schedule.min_lr_ratio=2", "min_lr_ratio"), ("optimizer.name=sgd", "optimizer.name"),
        ("train.precision=fp8", "train.precision"), ("train.device=tpu", "train.device"),
        ("train.device=cuda", "train.device"), ("train.recompute=partial", "train.recompute"),
        ("train.backend=jax", "train.backend"), ("logging.wandb_mode=cloud", "logging.wandb_mode"),
        ("schedule.name=zero_bubble", "schedule.name"), ("staleness.ef_lambda=-1", "staleness.ef_lambda"),
        ("staleness.ef_lambda=1", "staleness"), ("checkpoint.resume=latest", "checkpoint.resume"),
        ("checkpoint.resume={tmp}/nowhere/step_00000002", "checkpoint.resume"),
        ("out_dir=''", "out_dir"),
    ]:
        add("config", f"value-{override}", config(override, expect=expect))

    # -- options given to an optimizer that does not read them
    for opt, override, field in [
        ("adamw", "optimizer.momentum=0.5", "optimizer.momentum"), ("adamw", "optimizer.ns_steps=3", "optimizer.ns_steps"),
        ("adamw", "optimizer.adamw_lr=0.01", "optimizer.adamw_lr"), ("adamw", "optimizer.gamma=0.1", "optimizer.gamma"),
        ("adamw", "optimizer.precondition_frequency=5", "optimizer.precondition_frequency"),
        ("lion", "optimizer.eps=1e-6", "optimizer.eps"), ("muon", "optimizer.beta3=0.99", "optimizer.beta3"),
        ("signum", "optimizer.betas=[0.8,0.9]", "optimizer.betas"), ("mars", "optimizer.alpha=2", "optimizer.alpha"),
        ("soap", "optimizer.nesterov=false", "optimizer.nesterov"),
    ]:
        add("config", f"unused-{opt}-{override}", config(f"optimizer={opt}", override, expect=field))
    for opt, override in [("muon", "optimizer.momentum=0.9"), ("ademamix", "optimizer.alpha=8"),
                          ("mars", "optimizer.gamma=0.05"), ("soap", "optimizer.precondition_frequency=5")]:
        add("config", f"used-{opt}-{override}", config(f"optimizer={opt}", override, expect="ok"))

    # -- hydra: interpolations and the command line's syntax
    for override, expect in [
        ("train.steps=${oops}", "train.steps"), ("optimizer.lr=${train.missing}", "optimizer.lr"),
        ("seed=${seed}", "seed"), ("train.steps=${now:}", "train.steps"),
        ("trian.steps=3", "trian.steps"), ("+train.steps=3", "train.steps"), ("model=gpt5", "model=gpt5"),
        ("optimizer=sgd", "optimizer=sgd"), ("train.steps=[1,2]", "train.steps"), ("train.steps=", "train.steps"),
        ("train.steps", "train.steps"), ("train.steps=3,4", "train.steps"), ("=3", "=3"),
        ("~train.peak_tflops", "train.peak_tflops"),
    ]:
        add("config", f"hydra-{override}", config(override, expect=expect))
    add("config", "hydra-good-++train.steps=3", config("++train.steps=3", expect="ok"))
    add("config", "hydra-good-interpolation", config("optimizer=ademamix",
                                                     "optimizer.ademamix_warmup_steps=${train.steps}", expect="ok"))

    # -- resources before work
    add("config", "memory-micro_batch_size=100000", config("train.micro_batch_size=100000",
                                                           expect="train.micro_batch_size", if_accepted=HANG))
    add("config", "memory-seq_len=512-mbs=20000", config("train.seq_len=512", "train.micro_batch_size=20000",
                                                         expect="train.micro_batch_size", if_accepted=HANG))
    add("config", "memory-allow-oversubscribe", config("train.micro_batch_size=100000",
                                                       "train.allow_oversubscribe=true", expect="ok"))
    add("config", "sample-index-steps=1e12", config("train.steps=1000000000000", expect="train.steps",
                                                    if_accepted=HANG))
    add("config", "sample-index-steps=1e15", config("train.steps=1000000000000000", expect="train.steps",
                                                    if_accepted=HANG))

    # -- data
    add("data", "split-letters", config("data.split=abc", expect="data.split"))
    add("data", "split-four-parts", config("data.split='1,2,3,4'", expect="data.split"))
    add("data", "split-no-train", config("data.split='0,1,0'", expect="data.split"))
    add("data", "split-no-valid-with-eval", config("data.split='100,0,0'", "train.eval_every=2",
                                                   expect="data.split"))
    add("data", "split-negative", config("data.split='-1,2'", expect="data.split"))
    add("data", "blend-on-default", config("data.blend=[/x]", expect="data.blend"))
    add("data", "tokenizer-on-default", config("data.tokenizer=gpt2", expect="data.tokenizer"))
    for id_, blend, expect in [
        ("duplicate", "[{tmp}/a,{tmp}/a]", "data.blend[1]"),
        ("duplicate-weighted", "['0.5 {tmp}/a','0.5 {tmp}/a']", "data.blend[1]"),
        ("duplicate-spelt-differently", "[{tmp}/a,{tmp}/./a]", "data.blend[1]"),
        ("empty", "[]", "data.blend"),
        ("missing-prefix", "[{tmp}/nowhere]", "data.blend[0]"),
        ("names-the-bin", "[{tmp}/a.bin]", "data.blend[0]"),
        ("weight-zero", "['0 {tmp}/a']", "data.blend[0]"),
        ("weight-negative", "['-1 {tmp}/a']", "data.blend[0]"),
        ("weight-nan", "['nan {tmp}/a']", "data.blend[0]"),
        ("weight-only", "['0.5']", "data.blend[0]"),
        ("three-fields", "['0.5 {tmp}/a extra']", "data.blend[0]"),
        ("mixed-weighted-and-bare", "['0.5 {tmp}/a',{tmp}/b]", "data.blend"),
        ("weight-not-a-number", "['half {tmp}/a']", "data.blend[0]"),
        ("tokens-beyond-vocab", "[{tmp}/big]", "data.blend"),
        ("two-prefixes", "[{tmp}/a,{tmp}/b]", "ok"),
        ("weighted", "['0.7 {tmp}/a','0.3 {tmp}/b']", "ok"),
    ]:
        add("data", f"blend-{id_}", config(*IDX, f"data.blend={blend}", expect=expect, setup=prefixes))
    add("data", "cache_dir-is-a-file", config("data.cache_dir={tmp}/cachefile", expect="data.cache_dir",
                                              setup=a_plain_file("cachefile")))
    add("data", "cache_dir-unwritable", config("data.cache_dir=/proc/asyncpp-cache", expect="data.cache_dir"))

    # -- environment and output paths
    add("environment", "ASYNCPP_CACHE-unwritable", config(expect="ASYNCPP_CACHE",
                                                         env={"ASYNCPP_CACHE": "/proc/asyncpp-cache"}))
    add("environment", "ASYNCPP_CACHE-is-a-file", config(expect="ASYNCPP_CACHE", env={"ASYNCPP_CACHE": "{tmp}/f"},
                                                        setup=a_plain_file("f")))
    add("environment", "ASYNCPP_CACHE-under-a-file", config(expect="ASYNCPP_CACHE",
                                                           env={"ASYNCPP_CACHE": "{tmp}/f/cache"},
                                                           setup=a_plain_file("f")))
    add("environment", "ASYNCPP_CACHE-relative", config(expect="ok", env={"ASYNCPP_CACHE": ".cache/asyncpp"}))
    add("environment", "out_dir-is-a-file", config("out_dir={tmp}/f", expect="out_dir", setup=a_plain_file("f")))
    add("environment", "out_dir-unwritable", config("out_dir=/proc/asyncpp-run", expect="out_dir"))
    add("environment", "checkpoint.dir-is-a-file", config("checkpoint.dir={tmp}/f", expect="checkpoint.dir",
                                                         setup=a_plain_file("f")))
    add("environment", "checkpoint.dir-unwritable", config("checkpoint.dir=/proc/ckpt", expect="checkpoint.dir"))
    add("environment", "exit-file-unwritable", subprocess_case(
        ["pretrain.py", *BASE, "train.steps=0", "out_dir={tmp}/run"], expect="train.steps",
        env={"ASYNCPP_EXIT_FILE": "/proc/asyncpp-exit"}))
    add("environment", "exit-file-is-a-directory", subprocess_case(
        ["pretrain.py", *BASE, "parallel.pp=0", "out_dir={tmp}/run"], expect="parallel.pp",
        env={"ASYNCPP_EXIT_FILE": "{tmp}"}), slow=True)
    add("environment", "pretrain-typo-exit-2", subprocess_case(
        ["pretrain.py", *BASE, "trian.steps=3", "out_dir={tmp}/run"], expect="trian.steps"))

    # -- checkpoints: lineage, identity, data position, damage
    add("checkpoint", "resume-older-in-place", resume("checkpoint.resume={base}/checkpoints/step_00000002",
                                                      "optimizer.lr=0.001", into="base",
                                                      expect="checkpoint.resume", if_accepted=LOST))
    add("checkpoint", "resume-older-in-place-keep_last=1", resume(
        "checkpoint.resume={base}/checkpoints/step_00000002", "train.steps=3", "checkpoint.keep_last=1",
        into="base", expect="checkpoint.resume", if_accepted=LOST))
    add("checkpoint", "resume-older-into-shared-checkpoint.dir", resume(
        "checkpoint.resume={base}/checkpoints/step_00000002", "checkpoint.dir={base}/checkpoints", "train.steps=3",
        "checkpoint.keep_last=1", expect="checkpoint.resume", if_accepted=LOST))
    add("checkpoint", "resume-older-into-its-own-directory", resume(
        "checkpoint.resume={base}/checkpoints/step_00000002", "train.steps=3", "checkpoint.keep_last=1",
        expect="ok"))
    add("checkpoint", "resume-into-another-runs-directory", resume(
        "checkpoint.resume={tmp}/second/checkpoints/step_00000002", "train.steps=5", into="base",
        expect="checkpoint.resume", if_accepted=LOST, prepare=lambda base: shutil.copytree(base, base.parent / "second")))
    add("checkpoint", "fresh-start-over-checkpoints", resume("checkpoint.resume=none", into="base",
                                                             expect="checkpoint.resume", if_accepted=LOST))
    add("checkpoint", "resume-newest-with-more-steps", resume("train.steps=6", into="base", expect="ok",
                                                              continues=True))
    add("checkpoint", "resume-complete-run", resume(into="base", expect="train.steps"))
    for key, value in [("seed", "7"), ("model", "tiny_moe"), ("data.split", "'90,10,0'"), ("train.seq_len", "16"),
                       ("optimizer", "lion"), ("schedule", "1f1b")]:
        add("checkpoint", f"identity-{key}", resume(f"{key}={value}", "train.steps=6", into="base", expect=key.split("=")[0]
                                                   if key not in ("model", "optimizer", "schedule") else f"{key}.name",
                                                   continues=True))
    add("checkpoint", "data-position-micro_batch_size", resume("train.steps=6", "train.micro_batch_size=4",
                                                               into="base", expect="train.micro_batch_size",
                                                               continues=True))
    add("checkpoint", "data-position-num_microbatches", resume("train.steps=6", "train.num_microbatches=2",
                                                               into="base", expect="train.micro_batch_size",
                                                               continues=True))
    add("checkpoint", "data-position-same-batch-other-shape", resume(
        "train.steps=6", "train.micro_batch_size=1", "train.num_microbatches=8", into="base", expect="ok",
        continues=True))
    add("checkpoint", "data-position-rampup", resume("train.steps=6", "train.batch_rampup=[2,2,16]",
                                                     "train.global_batch_size=8", into="base",
                                                     expect="train.micro_batch_size", continues=True))
    for id_, damage in [("manifest-torn", truncate("manifest.json")),
                        ("manifest-without-step", rewrite_manifest(_drop("step"))),
                        ("manifest-step-a-string", rewrite_manifest(_set("step", "4"))),
                        ("manifest-not-an-object", rewrite_manifest(lambda m: [m["step"]])),
                        ("manifest-other-step", rewrite_manifest(_set("step", 3))),
                        ("metadata-missing", remove(".metadata")),
                        ("metadata-torn", truncate(".metadata", keep=100)),
                        ("shard-truncated", truncate("__0_0.distcp", keep=1000)),
                        ("shard-missing", remove("__0_0.distcp"))]:
        add("checkpoint", f"damaged-newest-{id_}", resume("train.steps=6", into="base", damage=damage, expect="ok",
                                                          warns="step_00000004 is damaged", expect_step=2))
    add("checkpoint", "damaged-explicit", resume("checkpoint.resume={base}/checkpoints/step_00000004",
                                                 "train.steps=6", into="base", damage=remove(".metadata"),
                                                 expect="checkpoint.resume"))
    add("checkpoint", "resume-not-a-checkpoint", resume("checkpoint.resume={base}/step_00000002", "train.steps=6",
                                                        into="base", expect="checkpoint.resume"))

    # -- launchers
    for id_, argv, expect in [
        ("time-25:99:99", ["--gpus-per-node", "0", "--time", "25:99:99"], "--time"),
        ("time-1-24:00:00", ["--gpus-per-node", "0", "--time", "1-24:00:00"], "--time"),
        ("time-00:00:00", ["--gpus-per-node", "0", "--time", "0:00:00"], "--time"),
        ("time-1:60", ["--gpus-per-node", "0", "--time", "1:60"], "--time"),
        ("time-words", ["--gpus-per-node", "0", "--time", "a day"], "--time"),
        ("time-90-minutes", ["--gpus-per-node", "0", "--time", "90"], "ok"),
        ("time-2-00:00:00", ["--gpus-per-node", "0", "--time", "2-00:00:00"], "ok"),
        ("time-48:00:00", ["--gpus-per-node", "0", "--time", "48:00:00"], "ok"),
        ("gpus-4-nproc-8", ["--gpus-per-node", "4", "--nproc-per-node", "8"], "--nproc-per-node"),
        ("gpus-8-nproc-8", ["--gpus-per-node", "8", "--nproc-per-node", "8"], "ok"),
        ("nodes-0", ["--gpus-per-node", "0", "--nodes", "0"], "--nodes"),
        ("gpus-negative", ["--gpus-per-node", "-1"], "--gpus-per-node"),
        ("rdzv-port-80", ["--gpus-per-node", "0", "--rdzv-port", "80"], "--rdzv-port"),
        ("job-name-space", ["--gpus-per-node", "0", "--job-name", "my job"], "--job-name"),
        ("env-without-value", ["--gpus-per-node", "0", "--env", "NOVALUE"], "--env"),
        ("log-dir-space", ["--gpus-per-node", "0", "--log-dir", "my logs"], "--log-dir"),
    ]:
        add("launcher", f"slurm-{id_}", tool(slurm_parse, *SLURM, *argv, expect=expect))
    add("launcher", "local-dry-run-bad-config", tool(local.main, "--nproc-per-node", "2", "--dry-run", "--",
                                                     "parallel.pp=0", expect="parallel.pp"))
    add("launcher", "local-dry-run-typo", tool(local.main, "--nproc-per-node", "2", "--dry-run", "--",
                                               "trian.steps=3", expect="trian.steps"), slow=True)
    for override in ("parallel.tp=0", "parallel.dp=-1", "parallel.ep=0"):
        add("launcher", f"world-size-2-{override}", config(override, "dry_run=2", expect=override.split("=")[0]))
    add("launcher", "local-nproc-0", tool(local.main, "--nproc-per-node", "0", "--dry-run", expect="--nproc-per-node"))
    add("launcher", "local-max-restarts-negative", tool(local.main, "--nproc-per-node", "1", "--max-restarts", "-1",
                                                        "--dry-run", expect="--max-restarts"))

    # -- tools
    add("tool", "hf-export-over-a-run", tool(hf.main, "export", "--model", "tiny_dense", "--tokenizer", "none",
                                             "--out", "{tmp}/out", expect="--out", guard="out", setup=run_dir_copy,
                                             if_accepted=LOST))
    add("tool", "hf-export-over-a-run-forced", tool(hf.main, "export", "--model", "tiny_dense", "--tokenizer", "none",
                                                    "--out", "{tmp}/out", "--force", expect="--out", guard="out",
                                                    setup=run_dir_copy, if_accepted=LOST))
    add("tool", "hf-export-into-non-empty", tool(hf.main, "export", "--model", "tiny_dense", "--tokenizer", "none",
                                                 "--out", "{tmp}/out", expect="--out", guard="out", setup=some_files,
                                                 if_accepted=LOST))
    add("tool", "hf-export-over-a-checkpoint", tool(hf.main, "export", "--model", "tiny_dense", "--tokenizer", "none",
                                                    "--out", "{tmp}/out/checkpoints/step_00000004", "--force",
                                                    expect="--out", guard="out", setup=run_dir_copy, if_accepted=LOST))
    add("tool", "hf-export-onto-a-file", tool(hf.main, "export", "--model", "tiny_dense", "--tokenizer", "none",
                                              "--out", "{tmp}/out", expect="--out", setup=a_file))
    add("tool", "hf-export-no-source", tool(hf.main, "export", "--out", "{tmp}/new", expect="--model"))
    add("tool", "hf-export-unknown-model", tool(hf.main, "export", "--model", "gpt5", "--out", "{tmp}/new",
                                                expect="gpt5"))
    add("tool", "hf-export-bad-set", tool(hf.main, "export", "--model", "tiny_dense", "--set", "qk_norm",
                                          "--out", "{tmp}/new", expect="qk_norm"))
    add("tool", "hf-export-missing-checkpoint", tool(hf.main, "export", "--checkpoint", "{tmp}/nowhere/step_00000002",
                                                     "--out", "{tmp}/new", expect="nowhere"))
    add("tool", "hf-export-damaged-checkpoint", tool(hf.main, "export", "--checkpoint",
                                                     "{tmp}/out/checkpoints/step_00000004", "--tokenizer", "none",
                                                     "--out", "{tmp}/new", expect="--checkpoint",
                                                     setup=lambda tmp, base: (run_dir_copy(tmp, base),
                                                                              remove(".metadata")(tmp / "out"))))
    add("tool", "hf-export-new-directory", tool(hf.main, "export", "--model", "tiny_dense", "--tokenizer", "none",
                                                "--out", "{tmp}/new", expect="ok"))
    add("tool", "hf-import-missing", tool(hf.main, "import", "{tmp}/nowhere", "--out", "{tmp}/x.pt",
                                          expect="nowhere"))
    issue_44_cases(add)
    return c


# ---- issue 44's round: the kinds of its new hostile inputs -------------------------------------------------
TOKENIZER = str(REPO / "data" / "default_corpus" / "tokenizer.json")
PREPROCESS = ["--workers", "0", "--no-progress"]


def a_jsonl_input(tmp: Path, base_run: Path | None = None) -> None:
    """{tmp}/in/corpus.json (a JSON-lines input named .json), {tmp}/in/tok.json and tokenizer.json (a tokenizer),
    {tmp}/in/notes.json (the user's), and a symlink {tmp}/link -> {tmp}/in."""
    (tmp / "in").mkdir()
    (tmp / "in" / "corpus.json").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                                                    for i in range(32)))
    shutil.copy(TOKENIZER, tmp / "in" / "tok.json")
    shutil.copy(TOKENIZER, tmp / "in" / "tokenizer.json")
    (tmp / "in" / "notes.json").write_text('{"mine": true}\n')
    (tmp / "link").symlink_to(tmp / "in")


def an_hf_directory(extra: bool = False) -> Callable[[Path, Path], None]:
    """{tmp}/hf: tiny_dense exported (no tokenizer); `extra`: its safetensors also hold a tensor no rule reads."""
    def setup(tmp: Path, base_run: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        from model_zoo import build_model, get_model_config

        cfg = get_model_config("tiny_dense")
        hf.export_state_dict(build_model(cfg).state_dict(), cfg, tmp / "hf")
        if extra:
            weights = tmp / "hf" / hf.WEIGHTS_FILE
            tensors = load_file(str(weights))
            tensors["score.weight"] = torch.zeros(2, cfg.hidden_size)  # a value head, say
            save_file(tensors, str(weights), metadata={"format": "pt"})
    return setup


def environment(env: dict, expect: str) -> Callable[..., Outcome]:
    """pretrain.py's first check, of torchrun's variables in a process torchrun may not have started."""
    def run(tmp: Path, base_run: Path, full: bool = False) -> Outcome:
        try:
            preflight.check_environment(env)
        except ConfigError as e:
            return _judge(expect, str(e), None, SILENT)
        except Exception as e:  # noqa: BLE001
            return Outcome(RAW, f"{type(e).__name__}: {e}")
        return _judge(expect, None, None, HANG)
    return run


def dry(*overrides: str, expect: str, copy_base: bool = False, if_accepted: str = SILENT) -> Callable[..., Outcome]:
    """dry_run=N as pretrain.py's main runs it: resolve, then the dry run's preflight (the real run's checks that do
    not depend on this machine's devices). `copy_base`: the base run copied to {tmp}/base (its out_dir)."""
    def run(tmp: Path, base_run: Path, full: bool = False) -> Outcome:
        if copy_base:
            shutil.copytree(base_run, tmp / "base")
        items = [*BASE, *_fill(overrides, tmp, tmp / "base")]
        if not any(o.startswith("out_dir=") for o in items):
            items.append(f"out_dir={tmp / 'base' if copy_base else tmp / 'run'}")
        before = _snapshot(tmp / "base") if copy_base else {}
        try:
            cfg, model_cfg = job.resolve(job.compose(items))
            preflight.check_dry_run(cfg, model_cfg, warn=lambda text: None)
        except (ConfigError, preflight.RunComplete) as e:  # a finished run's one line names train.steps
            outcome = _judge(expect, str(e), None, if_accepted)
        except Exception as e:  # noqa: BLE001
            outcome = Outcome(RAW, f"{type(e).__name__}: {e}")
        else:
            outcome = _judge(expect, None, None, if_accepted)
        if copy_base and _lost(before, tmp / "base"):
            return Outcome(LOST, f"changed: {_lost(before, tmp / 'base')[:4]}")
        return outcome
    return run


def sweep_case(sweep: list[str], expect: str, ran: int) -> Callable[..., Outcome]:
    """pretrain.py -m: a multirun whose first point is refused; the others must still run (`ran` of them write a
    summary.json), then exit 2 naming the bad point."""
    def run(tmp: Path, base_run: Path, full: bool = False) -> Outcome:
        args = ["pretrain.py", "-m", *[o for o in BASE if not o.startswith("train.steps")], "checkpoint.enabled=false",
                *sweep, f"hydra.sweep.dir={tmp / 'sweep'}"]
        proc = subprocess.run([sys.executable, *args], check=False, cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
        done = len(list((tmp / "sweep").rglob("summary.json")))
        if "Traceback" in proc.stderr:
            return Outcome(RAW, f"exit {proc.returncode}: {proc.stderr[-400:]}")
        if done < ran:
            return Outcome(SILENT, f"{done} of the {ran} good points ran (exit {proc.returncode}): {proc.stderr[-300:]}")
        if proc.returncode != 2:
            return Outcome(SILENT if proc.returncode == 0 else RAW, f"exit {proc.returncode}: {proc.stderr[-300:]}")
        return _judge(expect, proc.stderr.strip(), None, SILENT)
    return run


def megatron_example_args(argv: list[str]) -> int:
    """examples/megatron_2bw.py's argument check (parse_args; argparse's exit 2 naming the option)."""
    from examples.megatron_2bw import parse_args  # megatron-core's import: only for these cases

    parse_args(argv)
    return 0


def a_broken_sidecar(content: bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        _prefix(tmp, "a")
        (tmp / "a.json").write_bytes(content)
    return setup


def issue_44_cases(add: Callable[..., None]) -> None:
    from data import preprocess

    # -- a tool never writes over its own input (data.preprocess's <prefix>.json sidecar, its trained tokenizer, the
    #    .parts directory it removes; tools.hf import's .pt; tools.hf export's files), however the path is spelt
    for id_, expect, argv in [
        ("sidecar-is-the-input", "--output-prefix", ["--input", "{tmp}/in/corpus.json", "--tokenizer", TOKENIZER,
                                  "--output-prefix", "{tmp}/in/corpus"]),
        ("sidecar-is-the-input-via-symlink", "--output-prefix", ["--input", "{tmp}/in/corpus.json", "--tokenizer", TOKENIZER,
                                              "--output-prefix", "{tmp}/link/corpus"]),
        ("sidecar-is-the-input-relative", "--output-prefix", ["--input", "{tmp}/link/corpus.json", "--tokenizer", TOKENIZER,
                                           "--output-prefix", "{tmp}/in/../in/corpus"]),
        ("sidecar-is-the-tokenizer", "--output-prefix", ["--input", "{tmp}/in/corpus.json", "--tokenizer", "{tmp}/in/tok.json",
                                      "--output-prefix", "{tmp}/in/tok"]),
        ("sidecar-is-the-tokenizers-directory-file", "--output-prefix", ["--input", "{tmp}/in/corpus.json", "--tokenizer", "{tmp}/in",
                                                      "--output-prefix", "{tmp}/in/tokenizer"]),
        ("tokenizer-out-is-the-input", "--tokenizer-out", ["--input", "{tmp}/in/corpus.json", "--train-tokenizer", "300",
                                        "--tokenizer-out", "{tmp}/link/corpus.json", "--output-prefix", "{tmp}/o"]),
        ("trained-tokenizer-is-the-input", "--train-tokenizer", ["--input", "{tmp}/in/corpus.tokenizer.json", "--train-tokenizer", "300",
                                            "--output-prefix", "{tmp}/in/corpus"]),
        ("parts-directory-holds-the-input", "--output-prefix", ["--input", "{tmp}/in/corpus.json", "--tokenizer", TOKENIZER,
                                             "--output-prefix", "{tmp}/i"]),
    ]:
        setup = a_jsonl_input
        if id_ == "trained-tokenizer-is-the-input":
            def setup(tmp, base_run):
                a_jsonl_input(tmp)
                shutil.copy(tmp / "in" / "corpus.json", tmp / "in" / "corpus.tokenizer.json")
        if id_ == "parts-directory-holds-the-input":
            def setup(tmp, base_run):
                a_jsonl_input(tmp)
                (tmp / "i.parts").mkdir()
                shutil.copy(tmp / "in" / "corpus.json", tmp / "i.parts" / "corpus.json")
                (tmp / "in" / "corpus.json").unlink()
                (tmp / "in" / "corpus.json").symlink_to(tmp / "i.parts" / "corpus.json")
        add("tool", f"preprocess-{id_}", tool(preprocess.main, *argv, *PREPROCESS, expect=expect, guard=".",
                                               setup=setup, if_accepted=LOST))
    add("tool", "preprocess-sidecar-over-a-foreign-json", tool(
        preprocess.main, "--input", "{tmp}/in/corpus.json", "--tokenizer", TOKENIZER, "--output-prefix",
        "{tmp}/in/notes", *PREPROCESS, expect="--overwrite", guard="in", setup=a_jsonl_input, if_accepted=LOST))
    add("tool", "preprocess-beside-its-input", tool(
        preprocess.main, "--input", "{tmp}/in/corpus.json", "--tokenizer", TOKENIZER, "--output-prefix",
        "{tmp}/in/prepared", *PREPROCESS, expect="ok", setup=a_jsonl_input), slow=True)
    add("tool", "hf-import-over-its-weights", tool(hf.main, "import", "{tmp}/hf", "--out",
                                                   f"{{tmp}}/hf/{hf.WEIGHTS_FILE}", expect="--out", guard="hf",
                                                   setup=an_hf_directory(), if_accepted=LOST))
    add("tool", "hf-import-over-its-config", tool(hf.main, "import", "{tmp}/hf", "--out", "{tmp}/hf/../hf/config.json",
                                                  expect="--out", guard="hf", setup=an_hf_directory(),
                                                  if_accepted=LOST))
    add("tool", "hf-import-onto-a-directory", tool(hf.main, "import", "{tmp}/hf", "--out", "{tmp}/hf",
                                                   expect="--out", guard="hf", setup=an_hf_directory()))
    add("tool", "hf-export-over-its-tokenizer", tool(
        hf.main, "export", "--model", "tiny_dense", "--tokenizer", "{tmp}/in/tokenizer.json", "--out", "{tmp}/in",
        "--force", expect="--out", guard="in",
        setup=lambda tmp, base: ((tmp / "in").mkdir(), shutil.copy(TOKENIZER, tmp / "in" / "tokenizer.json")),
        if_accepted=LOST))
    add("tool", "hf-export-over-its-state-dict", tool(
        hf.main, "export", "--model", "tiny_dense", "--state-dict", f"{{tmp}}/in/{hf.WEIGHTS_FILE}", "--tokenizer",
        "none", "--out", "{tmp}/in", "--force", expect="--out", guard="in",
        setup=lambda tmp, base: ((tmp / "in").mkdir(), (tmp / "in" / hf.WEIGHTS_FILE).write_bytes(b"weights")),
        if_accepted=LOST))
    # -- options that silently did nothing: an import that drops tensors without a word
    add("tool", "hf-import-extra-tensors", tool(hf.main, "import", "{tmp}/hf", "--out", "{tmp}/x.pt",
                                                expect="score.weight", setup=an_hf_directory(extra=True)))
    add("tool", "hf-import-extra-tensors-dropped-on-request", tool(
        hf.main, "import", "{tmp}/hf", "--out", "{tmp}/x.pt", "--drop-extra", expect="ok",
        setup=an_hf_directory(extra=True)))
    add("tool", "hf-import-exported-model", tool(hf.main, "import", "{tmp}/hf", "--out", "{tmp}/x.pt", expect="ok",
                                                 setup=an_hf_directory()))

    # -- silent waits and outputs redirected: torchrun's variables in a process torchrun did not start
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}
    for id_, env, expect in [
        ("leftover-world", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", **rendezvous},
         "WORLD_SIZE=2"),
        ("leftover-world-size-only", {"WORLD_SIZE": "4"}, "WORLD_SIZE=4"),
        ("leftover-rank", {"RANK": "1"}, "RANK=1"),
        ("leftover-local-rank", {"LOCAL_RANK": "3"}, "LOCAL_RANK=3"),
        ("rank-not-a-number", {"RANK": "one"}, "RANK='one'"),
        ("world-size-empty", {"WORLD_SIZE": ""}, "ok"),
        ("single-process-values", {"RANK": "0", "WORLD_SIZE": "1", **rendezvous}, "ok"),
        ("under-torchrun", {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc", **rendezvous}, "ok"),
    ]:
        add("environment", f"torchrun-variables-{id_}", environment(env, expect))
    add("environment", "pretrain-leftover-world-exits-2", subprocess_case(
        ["pretrain.py", *BASE, "out_dir={tmp}/run"], expect="WORLD_SIZE=2",
        env={"RANK": "0", "WORLD_SIZE": "2", **rendezvous}, if_accepted=HANG), slow=True)

    # -- the dry run runs the real run's checks (and ends)
    for id_, overrides, expect in [
        ("ranks-1e6", ["dry_run=1000000"], "dry_run"),
        ("ranks-1e12", ["dry_run=1000000000000"], "dry_run"),
        ("head-placement-the-real-run-refuses", ["dry_run=2", "parallel.pp=2", "schedule=2bw", "parallel.head=vocab",
                                                 "parallel.vocab_placement=[8,8]"], "parallel.vocab_placement"),
        ("simulator-only-option", ["dry_run=2", "parallel.pp=2", "staleness.diagnostics_every=1"],
         "staleness.diagnostics_every"),
        ("sample-index-steps=1e12", ["dry_run=2", "train.steps=1000000000000"], "train.steps"),
        ("data-missing", [*IDX, "dry_run=2", "data.blend=[{tmp}/nowhere]"], "data.blend"),
        ("zero-row-shards-with-sharded-embedding", ["dry_run=2", "parallel.pp=2", "parallel.head=vocab",
                                                    "parallel.embedding=vocab", "parallel.vocab_shards=[0,8192]"],
         "ok"),
        ("good-layout", ["dry_run=2", "parallel.pp=2"], "ok"),
    ]:
        add("config", f"dry-run-{id_}", dry(*overrides, expect=expect, if_accepted=HANG if "ranks" in id_ else SILENT))
    add("checkpoint", "dry-run-of-a-complete-run", dry("dry_run=2", "parallel.pp=2", expect="train.steps",
                                                       copy_base=True))
    add("checkpoint", "dry-run-resume-older-in-place", dry(
        "dry_run=2", "checkpoint.resume={base}/checkpoints/step_00000002", "train.steps=6", expect="checkpoint.resume",
        copy_base=True))

    # -- a checkpoint option pointed at one step's directory
    add("checkpoint", "checkpoint.dir-is-a-step", resume("checkpoint.dir={base}/checkpoints/step_00000004",
                                                         "train.steps=6", expect="checkpoint.dir",
                                                         if_accepted=LOST))
    add("checkpoint", "out_dir-is-a-step", resume("out_dir={base}/checkpoints/step_00000004", "train.steps=6",
                                                  expect="out_dir", if_accepted=LOST))
    add("checkpoint", "out_dir-inside-a-step", resume("out_dir={base}/checkpoints/step_00000004/run",
                                                      "train.steps=6", expect="out_dir", if_accepted=LOST))

    # -- an option recorded in config.json that another resolved away: parallel.head=auto keeping the head last
    for id_, option, field in [("embedding", "parallel.embedding=vocab", "parallel.embedding=vocab"),
                               ("vocab_shards", "parallel.vocab_shards=[4096,4096]", "parallel.vocab_shards"),
                               ("vocab_placement", "parallel.vocab_placement=[2,1]", "parallel.vocab_placement")]:
        add("config", f"auto-head-last-with-{id_}", config("parallel.pp=2", "schedule=pipedream", "parallel.head=auto",
                                                           option, "dry_run=2", expect=field))
    add("config", "auto-head-vocab-with-embedding", config("parallel.pp=2", "schedule=2bw", "parallel.head=auto",
                                                           "parallel.embedding=vocab", "dry_run=2", expect="ok"))

    # -- layer-less stages (parallel.stage_layers with zeros, issue 44): accepted where they run (and equal the
    # simulator: tests/dist/test_layerless_stages.py, tests/matrix/space.py LAYERLESS), refused naming the field
    # otherwise; the dry run's check as the real run's
    for id_, overrides, expect in [
        ("issue-layout-pp6", ["dry_run=6", "parallel.pp=6", "parallel.stage_layers=[1,1,1,1,0,0]"], "ok"),
        ("every-layer-on-the-first-stage", ["dry_run=3", "parallel.pp=3", "parallel.stage_layers=[4,0,0]"], "ok"),
        ("first-stage-only-the-embedding", ["dry_run=2", "parallel.pp=2", "parallel.stage_layers=[0,4]"], "ok"),
        ("zeros-short-of-the-layers", ["dry_run=3", "parallel.pp=3", "parallel.stage_layers=[2,0,0]"],
         "parallel.stage_layers"),
        ("negative-entry", ["dry_run=2", "parallel.pp=2", "parallel.stage_layers=[5,-1]"], "parallel.stage_layers"),
        ("shorter-than-pp", ["dry_run=4", "parallel.pp=4", "parallel.stage_layers=[4,0]"], "parallel.stage_layers"),
        ("more-stages-than-layers-without-a-split", ["dry_run=6", "parallel.pp=6"], "parallel.pp"),
        # a middle stage with no layer and the head last holds no weight at all: its optimizer crashed the real run
        ("a-stage-holding-nothing", ["dry_run=4", "parallel.pp=4", "parallel.head=last",
                                     "parallel.stage_layers=[2,0,0,2]"], "parallel.stage_layers"),
        ("a-stage-holding-nothing-head-last", ["dry_run=4", "parallel.pp=4", "parallel.head=last",
                                               "parallel.stage_layers=[2,2,0,0]"], "parallel.stage_layers"),
        ("a-stage-holding-nothing-but-vocab-rows", ["dry_run=4", "parallel.pp=4", "schedule=2bw",
                                                    "parallel.head=vocab", "parallel.stage_layers=[2,0,0,2]"], "ok"),
        ("a-stage-holding-nothing-zero-rows", ["dry_run=3", "parallel.pp=3", "schedule=2bw", "parallel.head=vocab",
                                               "parallel.stage_layers=[2,0,2]", "parallel.vocab_shards=[4096,0,4096]"],
         "parallel.stage_layers"),
    ]:
        add("config", f"layerless-{id_}", config(*overrides, expect=expect))
    add("config", "dry-run-layerless-issue-layout-pp6", dry("dry_run=6", "parallel.pp=6",
                                                            "parallel.stage_layers=[1,1,1,1,0,0]", expect="ok"))

    # -- a sweep whose points after a bad one were dropped: every point runs, the bad one is reported, exit 2
    add("config", "sweep-bad-point-first", sweep_case(["train.steps=0,1"], expect="train.steps=0", ran=1), slow=True)

    # -- raw errors: examples/megatron_2bw.py checks its arguments before any process group
    for id_, argv, expect in [
        ("pp-0", ["--pp", "0"], "--pp"), ("tp-negative", ["--tp", "-1"], "--tp"),
        ("heads-do-not-split-hidden", ["--hidden-size", "64", "--num-attention-heads", "5"], "--hidden-size"),
        ("heads-do-not-split-over-tp", ["--num-attention-heads", "3", "--hidden-size", "63", "--tp", "2"],
         "--num-attention-heads"),
        ("layers-do-not-split-over-pp", ["--num-layers", "5"], "--num-layers"),
        ("microbatches-below-pp", ["--num-microbatches", "1"], "--num-microbatches"),
        ("lr-nan", ["--lr", "nan"], "--lr"), ("lr-0", ["--lr", "0"], "--lr"),
        ("clip-grad-0", ["--clip-grad", "0"], "--clip-grad"), ("ef-lambda-negative", ["--ef-lambda", "-1"], "--ef-lambda"),
        ("train-iters-0", ["--train-iters", "0"], "--train-iters"), ("seq-length-0", ["--seq-length", "0"], "--seq-length"),
        ("out-a-directory", ["--out", "{tmp}"], "--out"), ("cuda-without-one", ["--device", "cuda"], "--device"),
        ("defaults", [], "ok"),
    ]:
        add("tool", f"megatron-example-{id_}", tool(megatron_example_args, *argv, expect=expect))

    # -- raw errors: a broken dataset sidecar (<prefix>.json) is a clean config error again
    for id_, text in [("torn", b'{"tokenizer": "x", "tokenizer_sha'), ("a-list", b"[1, 2]"),
                      ("without-tokenizer", b'{"documents": 3}'), ("binary", b"\xff\xfe\x00")]:
        add("data", f"sidecar-{id_}", config("data.name=indexed", "data.blend=[{tmp}/a]", expect="a.json",
                                             setup=a_broken_sidecar(text)))


CASES = _cases()


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished 4-step tiny_dense run with checkpoints at steps 2 and 4 (what issue 29's examples start from)."""
    out = tmp_path_factory.mktemp("hostile") / "base"
    cfg, model_cfg = job.resolve(job.compose([*BASE, f"out_dir={out}"]))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        job.run(cfg, model_cfg)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    return out


REPORT: dict[str, list[str]] = {}


def test_the_corpus_is_large_and_covers_every_area():
    assert len(CASES) >= 250 and len({c.id for c in CASES}) == len(CASES)
    assert {c.area for c in CASES} == {"config", "data", "checkpoint", "environment", "launcher", "tool"}


def _record(case: Case, outcome: Outcome) -> None:
    REPORT[case.id] = [outcome.cls, outcome.detail[:300]]
    path = os.environ.get("ASYNCPP_HOSTILE_REPORT")
    if path:
        Path(path).write_text(json.dumps(REPORT, indent=1))


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c for c in CASES],
                         ids=[c.id for c in CASES])
def test_hostile_input(case: Case, tmp_path, base_run):
    outcome = case.run(tmp_path, base_run)
    _record(case, outcome)
    assert outcome.cls == CLEAR, outcome.detail


TRAINED = [c for c in CASES if c.area == "checkpoint"]


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAINED, ids=[c.id for c in TRAINED])
def test_hostile_input_trained(case: Case, tmp_path, base_run):
    """The checkpoint cases again, training whatever the checks accept (a resumed run really continues, and
    what it leaves shows whether it lost work)."""
    outcome = case.run(tmp_path, base_run, full=True)
    _record(case, outcome)
    assert outcome.cls == CLEAR, outcome.detail


# ---- issue 29's named examples that need more than a class -------------------------------------
def _train(overrides: list[str]) -> dict:
    cfg, model_cfg, _ = _resolve(overrides)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return job.run(cfg, model_cfg)


def test_keep_last_prunes_only_the_history_being_written_and_never_the_resumed_checkpoint(tmp_path, base_run):
    """Resume the newest checkpoint (step 4) in place with keep_last=1 and two more saves: step 5 goes when step 6
    is written, the checkpoint the run resumed from stays (a failed attempt restarts there), step 2 of the same
    history goes."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    resumed = _snapshot(run / "checkpoints" / "step_00000004")
    _train([*BASE, f"out_dir={run}", "train.steps=6", "checkpoint.every=1", "checkpoint.keep_last=1"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    assert _snapshot(run / "checkpoints" / "step_00000004") == resumed


def test_prune_keeps_later_steps_of_another_history(tmp_path):
    """A shared checkpoint.dir holding a later step of another history: the commit of step 3 with keep_last=1
    prunes step 1 of its own past, keeps step 4 (not this history's), and the step it resumed from (2)."""
    from asyncpp.train import checkpoint as ckpt

    for step in (1, 2, 3, 4):
        path = tmp_path / f"step_{step:08d}"
        path.mkdir()
        (path / ckpt.MANIFEST).write_text(json.dumps({"step": step}))
    ckpt.prune(tmp_path, 1, step=3, protect=tmp_path / "step_00000002")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003", "step_00000004"]


def test_resume_reads_exactly_the_next_unseen_samples(tmp_path, base_run, monkeypatch):
    """The samples a resumed run reads, compared with the uninterrupted run's: resuming step 2 of the base run
    (micro_batch_size=2, m=4) with micro_batch_size=1, m=8 (the same 8 samples a step) reads samples [16, 32) in
    steps 2-3, as the uninterrupted run did, and its consumed tokens are the uninterrupted run's; a shape that
    would skip samples (micro_batch_size=4) is refused naming the field, before anything is built."""
    from data.source import IndexedDataSource

    read: list[list[int]] = []
    original = IndexedDataSource.train_microbatch

    def recording(self, index):
        start = index * self.micro_batch_size
        read[-1].extend(range(start, start + self.micro_batch_size))
        return original(self, index)

    monkeypatch.setattr(IndexedDataSource, "train_microbatch", recording)
    read.append([])
    _train([*BASE, f"out_dir={tmp_path / 'whole'}", "checkpoint.enabled=false"])
    uninterrupted = read[-1]
    assert uninterrupted == list(range(32))
    fork = tmp_path / "fork"
    resume_from = f"checkpoint.resume={base_run}/checkpoints/step_00000002"
    read.append([])
    _train([*BASE, f"out_dir={fork}", resume_from, "train.micro_batch_size=1", "train.num_microbatches=8"])
    assert read[-1] == uninterrupted[16:]
    lines = [json.loads(x) for x in (fork / "metrics.jsonl").read_text().splitlines()]
    whole = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["consumed_tokens"] for r in lines] == [r["consumed_tokens"] for r in whole[2:]]
    read.append([])
    with pytest.raises(ConfigError, match=r"train.micro_batch_size=4.*consumed 16 samples in its 2 steps, but under "
                                          r"this batch shape step 2 starts at sample 32, so samples would be skipped"):
        _train([*BASE, f"out_dir={tmp_path / 'skip'}", resume_from, "train.micro_batch_size=4"])
    assert read[-1] == []


def test_record_exit_to_an_unwritable_file_keeps_the_exit_code(tmp_path, capsys):
    from asyncpp.train.run_identity import record_exit

    record_exit(2, "config error: x", path=str(tmp_path))  # a directory: the rename fails
    record_exit(2, "config error: x", path="/proc/asyncpp-exit")
    err = capsys.readouterr().err
    assert err.count("could not be written") == 2 and "Point $ASYNCPP_EXIT_FILE at a writable file" in err
    assert list(tmp_path.iterdir()) == []  # its temporary file removed
