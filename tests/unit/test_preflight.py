"""Issue 18: pre-flight checks (before any process group or model), the stable run identity, and the exit
code of a config error. Each fault is refused with a message naming the field, the value and the fix, and
the next run, with the fault gone, passes."""

from __future__ import annotations

import errno
import json
import struct
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncpp import job
from asyncpp.config import ConfigError
from asyncpp.train import checkpoint as ckpt
from asyncpp.train import preflight
from asyncpp.train.run_identity import derived_name, run_name, sweep_name
from data.indexed import HEADER_BYTES, MAGIC, IndexedDataError, check_prefix, check_token_ids
from model_zoo import build_model

ROOT = Path(__file__).resolve().parents[2]
BASE = ["logging=disabled", "logging.progress=false", "model=tiny_dense", "train.steps=6", "train.eval_every=0",
        "optimizer.schedule.warmup_steps=2"]


def config(tmp_path, *overrides):
    return job.resolve(job.compose([f"out_dir={tmp_path / 'run'}", *BASE, *overrides]))


def fake_checkpoint(root: Path, step: int, cfg) -> Path:
    """What resume reads first: a committed step_* directory with its manifest, and a one-tensor DCP shard and
    .metadata (the pre-flight check reads no tensor, but checks that the shards are whole)."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    ckpt.quiet_single_process_dcp()
    dcp.save({"x": torch.zeros(4)}, checkpoint_id=str(path), no_dist=True)
    (path / ckpt.MANIFEST).write_text(json.dumps({"step": step, "config": cfg.to_dict()}))
    return path


# ---- device --------------------------------------------------------------------------------------
def test_cuda_on_a_machine_without_it_is_refused_before_anything_starts(tmp_path, monkeypatch):
    cfg, _ = config(tmp_path, "train.device=cuda")
    no_gpu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
    monkeypatch.setattr(preflight.torch.version, "cuda", "12.4")  # a CUDA build, no driver
    with pytest.raises(ConfigError, match="train.device=cuda but no CUDA device is visible.*train.device=cpu"):
        preflight.check_device(cfg, cuda=no_gpu)
    two = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2)
    with pytest.raises(ConfigError, match="4 ranks on this node, but only 2 GPU"):
        preflight.check_device(cfg, local_world_size=4, cuda=two)
    preflight.check_device(cfg, local_world_size=2, cuda=two)
    monkeypatch.setattr(preflight.torch.version, "cuda", None)
    with pytest.raises(ConfigError, match="built without CUDA"):
        preflight.check_device(cfg, cuda=two)
    preflight.check_device(config(tmp_path)[0], cuda=no_gpu)  # the fix: train.device=cpu


def test_a_config_error_exits_2_before_any_model_and_tells_the_launcher(tmp_path):
    """Through pretrain.py's main, as torchrun or launch.local runs it (this machine has no CUDA build, or
    no GPU: either way the device check refuses it)."""
    marker = tmp_path / "exit"
    env = {"PATH": "/usr/bin:/bin", "ASYNCPP_EXIT_FILE": str(marker), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "pretrain.py", f"hydra.run.dir={tmp_path / 'run'}", *BASE,
                          "train.device=cuda"], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if preflight.torch.cuda.is_available():
        pytest.skip("this machine has CUDA: train.device=cuda is valid here")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "config error: train.device=cuda" in out.stderr and "use train.device=cpu" in out.stderr
    assert marker.read_text().startswith("2 config error: train.device=cuda")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no model, no metrics: nothing started


@pytest.mark.slow  # re-tiered (session 8, the default suite's budget): 26 s (pretrain.py subprocesses)
def test_an_override_hydra_refuses_is_a_config_error_and_a_crash_is_not(tmp_path):
    """hydra refuses `trian.steps=3` before main runs (its own sys.exit(1)); pretrain.py makes that exit 2 with the
    launcher's note, as for any config error (torchrun and the slurm script retried it as a crash). A crash inside
    the run stays 1, with no note: it is what the launchers retry."""
    marker = tmp_path / "exit"
    env = {"PATH": "/usr/bin:/bin", "ASYNCPP_EXIT_FILE": str(marker), "HOME": str(tmp_path)}
    # A plain command line is composed before hydra's app runs (pretrain.check_command_line): the typo is named.
    out = subprocess.run([sys.executable, "pretrain.py", f"hydra.run.dir={tmp_path / 'run'}", *BASE, "trian.steps=3"],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "trian.steps is not a config key; did you mean train.steps?" in out.stderr
    assert marker.read_text().startswith("2 config error: trian.steps is not a config key")
    marker.unlink()
    # A multirun (-m) goes to hydra as it is: its own refusal ends in sys.exit(1) before main, made exit 2 here.
    out = subprocess.run([sys.executable, "pretrain.py", "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", *BASE,
                          "trian.steps=3"], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Could not override 'trian.steps'" in out.stderr
    assert marker.read_text().startswith("2 config error: hydra could not compose the config")
    marker.unlink()
    crash = ("import runpy, sys\nimport asyncpp.job as job\n"
             "def boom(*args, **kwargs):\n    raise RuntimeError('a crash inside the run')\n"
             "job.run = boom\n"
             f"sys.argv = ['pretrain.py', 'hydra.run.dir={tmp_path / 'run'}', *{BASE!r}]\n"
             "runpy.run_path('pretrain.py', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", crash], check=False, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "a crash inside the run" in out.stderr, out.stderr[-2000:]
    assert not marker.exists()


# ---- storage -------------------------------------------------------------------------------------
def test_an_unwritable_checkpoint_dir_is_refused_then_a_writable_one_passes(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg, _ = config(tmp_path, f"checkpoint.dir={blocker / 'ckpt'}")  # under a regular file: not even root writes
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*a_file/ckpt is not writable \(Not a directory\)"):
        preflight.check_directories(cfg)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    cfg, _ = config(tmp_path, f"checkpoint.dir={tmp_path / 'ro'}")
    monkeypatch.setattr(preflight.tempfile, "mkstemp", read_only)
    with pytest.raises(ConfigError, match=r"out_dir \(hydra.run.dir\)=.* is not writable \(Read-only file system\)"):
        preflight.check_directories(cfg)
    monkeypatch.undo()
    preflight.check_directories(cfg)
    assert not list((tmp_path / "ro").iterdir())  # the probe leaves nothing behind


def test_too_little_disk_for_the_checkpoints_kept_is_refused(tmp_path):
    """The room asked for is what keep_last really keeps plus the one written before the oldest is pruned (issue 44:
    it asked for 2 while keep_last=3 kept 3 and wrote a 4th), and no more than the run writes."""
    cfg, model_cfg = config(tmp_path, "train.steps=20", "checkpoint.every=2", "checkpoint.every_minutes=0")
    preflight.check_directories(cfg)
    size = preflight.checkpoint_bytes(cfg, model_cfg)
    n = sum(p.numel() for p in build_model(model_cfg, device="meta").parameters())
    assert size > 4 * 2 * n  # 2BW: two weight versions (fp32 here), plus Muon's/AdamW's state (and EF's when on)

    def disk(free):
        return lambda path: types.SimpleNamespace(free=free)

    assert cfg.checkpoint.keep_last == 3
    with pytest.raises(ConfigError, match=r"checkpoint.dir \(default: <out_dir>/checkpoints\)=.* GiB free, but this "
                                          r"run needs room for 4 checkpoints .*checkpoint.keep_last=3 kept and the "
                                          r"next one written"):
        preflight.check_disk_space(cfg, size, disk_usage=disk(4 * size - 1))
    preflight.check_disk_space(cfg, size, disk_usage=disk(4 * size))
    keep_one, _ = config(tmp_path, "train.steps=20", "checkpoint.every=2", "checkpoint.keep_last=1")
    assert preflight.checkpoints_on_disk(keep_one) == 2
    two_saves, _ = config(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.every_minutes=0")
    assert preflight.checkpoints_on_disk(two_saves) == 2  # steps 2 and 4: fewer than keep_last + 1
    assert preflight.checkpoints_on_disk(cfg, (tmp_path, 18)) == 1  # resumed at 18: only step 20 is left to write
    timed, _ = config(tmp_path, "train.steps=4", "checkpoint.every=2", "checkpoint.every_minutes=5")
    assert preflight.checkpoints_on_disk(timed) == 4  # timed saves come at any step: keep_last + 1


def test_a_dry_run_warns_where_the_real_run_refuses_the_checkpoints_disk(tmp_path, monkeypatch):
    """A dry run plans another machine's job (issue 47: the 8-GPU recipe's plan was refused on a laptop for want of
    759 GiB of checkpoint space): the shortfall is a warning there, and the real run's refusal stays."""
    real = preflight.check_disk_space
    monkeypatch.setattr(preflight, "check_disk_space", lambda *a, **k: real(
        *a, **k, disk_usage=lambda path: types.SimpleNamespace(free=2**20)))
    said: list[str] = []
    dry, model_cfg = config(tmp_path, "dry_run=1")
    preflight.check_dry_run(dry, model_cfg, warn=said.append)
    assert len(said) == 1 and said[0].startswith("warning: checkpoint.dir") and "the plan goes on" in said[0]
    cfg, model_cfg = config(tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoint.dir .* GiB free, but this run needs room"):
        preflight.check(cfg, model_cfg)


def test_the_estimate_matches_a_real_checkpoint(tmp_path):
    """The size the disk check asks for is the size a save writes (within DCP's metadata overhead)."""
    import torch

    cfg, model_cfg = config(tmp_path, "optimizer=adamw")
    torch.manual_seed(0)
    model = build_model(model_cfg)
    from asyncpp.reference.executor import ReferenceExecutor
    from asyncpp.train.trainer import Trainer

    metrics = job.make_metrics(cfg, model_cfg)
    executor = ReferenceExecutor(cfg, model, job.build_from_config(model, cfg.optimizer),
                                 job.build_data(cfg, model_cfg))
    Trainer(cfg, executor, metrics).run()
    metrics.close({})
    written = preflight.checkpoint_bytes(cfg, model_cfg, (ckpt.latest(ckpt.checkpoint_root(cfg)), 6))
    estimate = preflight.checkpoint_bytes(cfg, model_cfg)
    assert 0.9 * written <= estimate <= 1.5 * written, (estimate, written)


def test_stale_temporaries_are_cleaned_at_start(tmp_path):
    cfg, model_cfg = config(tmp_path)
    stale = ckpt.checkpoint_root(cfg) / ".tmp-step_00000004-0badc0de"
    stale.mkdir(parents=True)
    said = []
    preflight.check(cfg, model_cfg, warn=said.append)
    assert not stale.exists() and "removed 1 unfinished checkpoint" in said[0]


def test_a_fresh_start_keeps_an_earlier_runs_record_byte_for_byte(tmp_path):
    """An earlier run without checkpoints (or one that crashed before its first) left metrics and a summary: a
    fresh start in the same out_dir moves them aside instead of appending to and overwriting them."""
    cfg, model_cfg = config(tmp_path, "checkpoint.enabled=false")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    earlier = {"metrics.jsonl": b'{"step": 0, "loss": 9.0}\n', "summary.json": b'{"steps": 1}', "timeline.png": b"png"}
    for name, data in earlier.items():
        (out / name).write_bytes(data)
    said = []
    preflight.check(cfg, model_cfg, warn=said.append)
    assert not (out / "metrics.jsonl").exists() and not (out / "summary.json").exists()
    assert {n: (out / "earlier_1" / n).read_bytes() for n in earlier} == earlier
    assert any("moved metrics.jsonl, summary.json, timeline.png to" in s for s in said), said
    (out / "metrics.jsonl").write_bytes(b"second\n")  # and the next fresh start keeps that one apart too
    preflight.check(cfg, model_cfg, warn=said.append)
    assert (out / "earlier_2" / "metrics.jsonl").read_bytes() == b"second\n"
    assert preflight.keep_an_earlier_run(cfg) is None  # nothing left to keep


# ---- resume --------------------------------------------------------------------------------------
def test_resume_from_a_missing_or_incomplete_path_is_refused(tmp_path):
    root = tmp_path / "ckpts"
    good = fake_checkpoint(root, 4, config(tmp_path)[0])
    cfg, _ = config(tmp_path, f"checkpoint.resume={root / 'step_00000009'}")
    with pytest.raises(ConfigError, match=r"step_00000009 does not exist; the complete ones in .* are "
                                          r"\['step_00000004'\]"):
        preflight.check_resume(cfg)
    (good / ckpt.MANIFEST).unlink()
    cfg, _ = config(tmp_path, f"checkpoint.resume={good}")
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        preflight.check_resume(cfg)


@pytest.mark.parametrize("changed, refused", [
    (["model=tiny_hybrid"], "model.name"),
    (["optimizer=adamw"], "optimizer.name"),
    (["schedule=sync"], "schedule.name"),
])
def test_resume_with_another_model_optimizer_or_schedule_is_refused_listing_what_differs(tmp_path, changed, refused):
    saved_cfg, _ = config(tmp_path)
    fake_checkpoint(ckpt.checkpoint_root(saved_cfg), 3, saved_cfg)
    cfg, _ = config(tmp_path, *changed)
    with pytest.raises(ConfigError, match=rf"saved with another .*{refused}.*Differences: .*{refused}: checkpoint"):
        preflight.check_resume(cfg)
    assert preflight.check_resume(saved_cfg) == (ckpt.latest(ckpt.checkpoint_root(cfg)), 3)  # same config: fine


def test_a_changed_hyperparameter_is_listed_but_resumes(tmp_path):
    saved_cfg, _ = config(tmp_path)
    fake_checkpoint(ckpt.checkpoint_root(saved_cfg), 3, saved_cfg)
    said = []
    cfg, _ = config(tmp_path, "optimizer.lr=0.005", "logging.log_every=3", "checkpoint.every=2")
    assert preflight.check_resume(cfg, warn=said.append)[1] == 3
    path = ckpt.latest(ckpt.checkpoint_root(cfg))
    assert said == [f"warning: resuming {path} (step 3) with a changed config: optimizer.lr: checkpoint 0.01, this run 0.005"]


def test_an_option_added_since_the_checkpoint_and_left_off_is_no_change(tmp_path):
    """A checkpoint saved before train.batch_rampup existed resumes without a warning while the ramp is off; one
    saved with a ramp lists the change when the ramp changes (the data position follows the new ramp)."""
    saved_cfg, _ = config(tmp_path)
    path = fake_checkpoint(ckpt.checkpoint_root(saved_cfg), 3, saved_cfg)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    del manifest["config"]["train"]["batch_rampup"]
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    said = []
    assert preflight.check_resume(saved_cfg, warn=said.append)[1] == 3 and said == []
    cfg, _ = config(tmp_path, "train.batch_rampup=[8,8,100]")
    assert preflight.check_resume(cfg, warn=said.append)[1] == 3
    assert said == [(f"warning: resuming {path} (step 3) with a changed config: train.batch_rampup: checkpoint "
                     "'<absent>', this run [8, 8, 100]")]


def test_train_steps_below_the_checkpoint_step_is_refused_and_at_it_complete(tmp_path):
    saved_cfg, _ = config(tmp_path)
    fake_checkpoint(ckpt.checkpoint_root(saved_cfg), 6, saved_cfg)
    _, step = preflight.check_resume(saved_cfg)  # complete: job.run* says so in one line, exit 0
    assert step == 6 and preflight.completed(saved_cfg).startswith(f"run complete: {saved_cfg.out_dir} is at step 6")
    with pytest.raises(ConfigError, match=r"train.steps=5, but .* is at step 6: a run cannot be shortened\. "
                                          r"Raise train.steps to 6"):
        preflight.check_resume(config(tmp_path, "train.steps=5")[0])
    with pytest.raises(ConfigError, match=r"checkpoint.resume=none, but .* holds the checkpoints of an earlier run "
                                          r"\(step_00000006\); a fresh start there would replace or prune them"):
        preflight.check_resume(config(tmp_path, "checkpoint.resume=none")[0])
    assert preflight.check_resume(config(tmp_path, "checkpoint.resume=none", "checkpoint.enabled=false")[0]) is None


# ---- data ----------------------------------------------------------------------------------------
def write_prefix(prefix: Path, docs: list[list[int]]) -> Path:
    """A Megatron .bin/.idx pair of uint16 tokens, written by hand (data/indexed.py has the layout)."""
    lengths = np.array([len(d) for d in docs], "<i4")
    pointers = (np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, 8, len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype="<i8").tobytes())
    np.concatenate([np.array(d, "<u2") for d in docs]).tofile(f"{prefix}.bin")
    assert Path(f"{prefix}.idx").stat().st_size == HEADER_BYTES + 12 * len(docs) + 8 * (len(docs) + 1)
    return prefix


def test_a_garbage_bin_is_refused_naming_the_file(tmp_path):
    rng = np.random.default_rng(0)
    prefix = write_prefix(tmp_path / "corpus", [list(rng.integers(0, 1000, 50)) for _ in range(200)])
    check_token_ids(check_prefix(prefix), 1000)
    garbage = rng.integers(0, 65536, 200 * 50, dtype=np.uint16)  # same size: check_prefix cannot tell
    garbage.astype("<u2").tofile(f"{prefix}.bin")
    info = check_prefix(prefix)
    with pytest.raises(IndexedDataError, match=rf"{prefix}.bin holds token id \d+ at token \d+ \(sequence \d+\), "
                                               r"outside the vocabulary \[0, 1000\).*data.preprocess"):
        check_token_ids(info, 1000)
    cfg, model_cfg = config(tmp_path, "data.name=indexed", f"data.blend=[{prefix}]", "data.tokenizer=x")
    with pytest.raises(ConfigError, match=r"data.blend: .*corpus.bin holds token id"):
        preflight.check_data(cfg, model_cfg.__class__(**{**model_cfg.__dict__, "vocab_size": 1000}))


def test_a_bad_id_in_the_last_document_is_found(tmp_path):
    docs = [[1, 2, 3]] * 500 + [[4, 5, 999]]
    info = check_prefix(write_prefix(tmp_path / "c", docs))
    with pytest.raises(IndexedDataError, match="token id 999 at token 1502 \\(sequence 500\\)"):
        check_token_ids(info, 999)


# ---- run identity --------------------------------------------------------------------------------
def test_the_run_name_is_the_command_not_the_clock():
    a = ["model=tiny_dense", "schedule=2bw", "train.steps=100"]
    # train.steps is how far the run goes, not which run it is: a larger one continues it (test_continue_run.py)
    assert derived_name(a) == derived_name(list(reversed(a))) == "model=tiny_dense,schedule=2bw"
    # where and how a run goes does not change which run it is
    assert derived_name([*a, "checkpoint.resume=auto", "logging=disabled", "train.device=cuda",
                         "hydra.run.dir=x", "+logging.progress=false", "hydra/launcher=slurm"]) == derived_name(a)
    assert derived_name([]) == "default" and derived_name(["logging.wandb_mode=online"]) == "default"
    assert derived_name(["seed=1", *a]) != derived_name(["seed=2", *a])  # each sweep job its own directory
    blend = derived_name(["data.blend=[/data/a b,/data/c]"])
    assert "/" not in blend and " " not in blend
    long = [f"optimizer.lr={i}" for i in range(40)]
    assert len(derived_name(long)) <= 120 and derived_name(long) != derived_name(long[:-1])
    assert run_name("sync vs 2bw", a) == "sync_vs_2bw" and run_name(None, a) == derived_name(a)
    assert sweep_name(None) == "sweep" and sweep_name("x") == "x"


@pytest.mark.slow  # re-tiered (session 8, the default suite's budget): 12 s (two pretrain.py runs)
def test_rerunning_the_same_command_finds_the_same_directory(tmp_path):
    """hydra.run.dir as pretrain.py resolves it: no timestamp, the same for the same overrides."""
    def run_dir(*overrides):
        cmd = [sys.executable, "pretrain.py", *overrides, "--cfg", "all", "--resolve", "-p", "hydra.run.dir"]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout.strip()

    first = run_dir("model=tiny_dense", "schedule=sync")
    assert first == "outputs/model=tiny_dense,schedule=sync"
    assert run_dir("schedule=sync", "model=tiny_dense", "checkpoint.resume=auto") == first
    assert run_dir("logging.run_name=mine") == "outputs/mine"
