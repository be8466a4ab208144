"""Issue 18, around the loop: a checkpoint never holds garbage and a complete one is never lost; metrics.jsonl
never holds a step twice; a crash never overwrites summary.json. No training here: a small StageState."""

from __future__ import annotations

import errno
import json
import time

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from asyncpp.core.records import StepMetrics
from asyncpp.train import checkpoint as ckpt
from asyncpp.train.checkpoint import saver as saver_module
from asyncpp.train.metrics import MetricsLogger, wandb_run_id


def _state(value: float = 1.0) -> ckpt.StageState:
    w = torch.full((4, 3), value)
    b = torch.zeros(3)
    opt = torch.optim.SGD([w, b], lr=0.1, momentum=0.9)
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()  # momentum buffers exist: optimizer state is saved too
    return ckpt.StageState(["w", "b"], {0: [w, b]}, {"ef": [torch.zeros_like(w), torch.zeros_like(b)]}, opt, [w, b])


def _save(saver: ckpt.Saver, root, step: int, state=None, keep_last: int = 3):
    return saver.save(root, step, state or _state(), config={"step": step}, layout={}, keep_last=keep_last)


def _steps(root) -> list[int]:
    return [int(p.name.split("_")[1]) for p in ckpt.list_checkpoints(root)]


@pytest.mark.parametrize("where", ["weights", "optimizer", "ef"])
def test_non_finite_state_is_refused_and_never_prunes_the_good_ones(tmp_path, where):
    saver = ckpt.Saver()
    for step in (1, 2):
        _save(saver, tmp_path, step, keep_last=2)
    bad = _state()
    if where == "weights":
        bad.versions[0][0][1, 2] = float("nan")
    elif where == "optimizer":
        next(iter(bad.optimizer.state.values()))["momentum_buffer"][0] = float("inf")
    else:
        bad.buffers["ef"][1][0] = float("-inf")
    assert ckpt.nonfinite_tensors(bad) and not ckpt.nonfinite_tensors(_state())
    with pytest.raises(ckpt.NonFiniteState, match=r"step 3 refused: 1 tensor\(s\) hold NaN/Inf.*step_00000002"):
        _save(saver, tmp_path, 3, bad, keep_last=2)
    assert _steps(tmp_path) == [1, 2]  # nothing written, nothing pruned
    assert not list(tmp_path.glob(".tmp-step_*"))


def test_all_finite_is_one_check_over_many_tensors():
    assert ckpt.all_finite([torch.ones(3), torch.arange(4)])  # integer tensors are finite
    assert not ckpt.all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert ckpt.all_finite([])


def test_finite_values_whose_sum_overflows_are_finite():
    """The check sums each tensor (one read instead of a bool tensor as large): a sum that overflows although every
    value is finite is checked element by element, so it is not taken for a NaN/Inf."""
    for dtype in (torch.float32, torch.bfloat16):
        big = torch.full((4,), 3e38, dtype=dtype)
        assert not torch.isfinite(big.sum()) and ckpt.all_finite([big])
        assert not ckpt.all_finite([big, torch.tensor([0.0, float("-inf")], dtype=dtype)])


def test_async_save_is_committed_without_waiting_for_the_next_save(tmp_path):
    """Issue 18, item 3: the step-10 save was written but committed only at the next save, so a kill -9
    lost it. Now rank 0 commits from DCP's completion callback: no wait(), no further save()."""
    saver = ckpt.Saver(async_save=True)
    _save(saver, tmp_path, 10)
    deadline = time.monotonic() + 30
    # The commit renames the directory, then marks the save done: wait for both (under load the test saw the
    # directory an instant before the flag).
    while not (ckpt.latest(tmp_path) is not None and saver.committed) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _steps(tmp_path) == [10] and saver.committed
    assert not list(tmp_path.glob(".tmp-step_*"))
    manifest = ckpt.read_manifest(tmp_path / "step_00000010")
    assert manifest["step"] == 10
    loaded = _state(0.0)
    ckpt.load(tmp_path / "step_00000010", loaded, ages=[0])
    assert torch.equal(loaded.versions[0][0], _state().versions[0][0])
    saver.wait()


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_fails_clearly_removes_the_partial_save_and_keeps_the_last_good_one(tmp_path, monkeypatch,
                                                                                          async_save):
    saver = ckpt.Saver(async_save)
    _save(saver, tmp_path, 5)
    saver.wait()
    monkeypatch.setattr(dcp_fs, "_write_item", _no_space)  # inside DCP's writer: it wraps the error
    with pytest.raises(ckpt.NoSpaceLeft, match=r"^no space left on device: writing checkpoint .*step_00000010 needs "
                       r"~.* free \(the partial \.tmp-step_00000010.* removed.*newest complete checkpoint is "
                       r".*step_00000005"):
        _save(saver, tmp_path, 10)
        saver.wait()
    assert _steps(tmp_path) == [5]
    assert not list(tmp_path.glob(".tmp-step_*"))
    monkeypatch.undo()  # space again: the next save works
    _save(saver, tmp_path, 10)
    saver.wait()
    assert _steps(tmp_path) == [5, 10]


def test_only_complete_checkpoints_are_listed_and_stale_temporaries_are_cleaned(tmp_path):
    _save(ckpt.Saver(), tmp_path, 4)
    (tmp_path / "step_00000008").mkdir()  # shards written, never committed (no manifest)
    (tmp_path / ".tmp-step_00000012-deadbeef").mkdir()
    assert _steps(tmp_path) == [4] and ckpt.latest(tmp_path).name == "step_00000004"
    with pytest.raises(FileNotFoundError, match=r"no manifest.json"):
        ckpt.read_manifest(tmp_path / "step_00000008")
    assert [p.name for p in ckpt.clean_stale(tmp_path)] == [".tmp-step_00000012-deadbeef"]
    assert not list(tmp_path.glob(".tmp-step_*")) and ckpt.clean_stale(tmp_path) == []


# ---- metrics -------------------------------------------------------------------------------------
def _logger(out, steps: int = 10) -> MetricsLogger:
    return MetricsLogger(out, total_steps=steps, progress=False)


def _record(step: int, loss: float = 0.0) -> StepMetrics:
    """A step record; only its step and loss matter to these tests."""
    return StepMetrics(step=step, loss=loss, lr=1e-3, grad_norm=1.0, update_norm=0.1, tokens_per_s=1.0,
                       step_time_s=1.0, skipped=False, sync_step=False, global_batch_size=1, consumed_tokens=step + 1)


def _logged_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_rerun_without_a_checkpoint_writes_each_step_once(tmp_path):
    """Issue 18, item 5: the rerun appended steps 0-5 a second time."""
    for attempt in range(2):
        m = _logger(tmp_path)
        for step in range(6 if attempt == 0 else 4):
            m.log(_record(step, float(attempt)))
        m.close()
    # the rerun started afresh at step 0: the file is its own (0-3), not attempt 0's 0-5 followed by 0-3
    assert _logged_steps(tmp_path) == [0, 1, 2, 3]
    assert [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1.0] * 4


def test_a_resumed_attempt_rewinds_to_its_first_step_and_drops_a_torn_line(tmp_path):
    m = _logger(tmp_path)
    for step in range(5):
        m.log(_record(step))
    m.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # the writer was killed mid-line
    m = _logger(tmp_path)
    m.log(_record(3))  # resumed at step 3
    m.log(_record(4))
    m.close()
    assert _logged_steps(tmp_path) == [0, 1, 2, 3, 4]


def test_rewinding_with_nothing_to_drop_writes_nothing(tmp_path, monkeypatch):
    """A resume on a full disk must not fail in the rewind (issue 18, item 6)."""
    m = _logger(tmp_path)
    for step in range(3):
        m.log(_record(step))
    m.close()

    def refuse(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("asyncpp.train.metrics.os.replace", refuse)
    m = _logger(tmp_path)
    m.rewind(3)  # nothing at or past step 3: no rewrite
    with pytest.raises(OSError, match="rewinding .* to step 1 failed.*the file is unchanged"):
        m.rewind(1)
    m.close()
    assert _logged_steps(tmp_path) == [0, 1, 2] and not (tmp_path / "metrics.jsonl.tmp").exists()


def test_a_crash_never_overwrites_the_summary(tmp_path):
    m = _logger(tmp_path)
    m.log(_record(0))
    m.close({"steps": 1, "final_loss": float("nan")})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 1, "final_loss": "nan"}
    m = _logger(tmp_path)
    m.close({})  # what pretrain.py's `finally` passes after a crash
    m = _logger(tmp_path)
    m.close()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1


def test_wandb_resumes_the_run_id_stored_in_the_run_directory(tmp_path, monkeypatch):
    """Issue 18, item 9: every restart opened a new wandb run."""
    import sys
    import types

    inits = []

    class Run:
        def __init__(self):
            self.summary = {}

        def finish(self, exit_code=0):
            inits[-1]["exit_code"] = exit_code

    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or Run(), Settings=dict)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for _ in range(2):  # a run and its restart
        MetricsLogger(tmp_path, total_steps=1, progress=False, wandb_mode="offline").close()
    assert inits[0]["id"] == inits[1]["id"] == (tmp_path / "wandb_run_id").read_text()
    assert inits[0]["resume"] == inits[1]["resume"] == "allow"
    assert inits[0]["settings"] == {"quiet": True}  # no ~30-line history footer on the console (issue 47)
    assert inits[0]["exit_code"] == 1  # closed without a summary: a failed attempt
    (tmp_path / "other").mkdir()
    assert wandb_run_id(tmp_path / "other") != inits[0]["id"]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_reported_by_torchs_writer_is_no_space_left(tmp_path, monkeypatch, async_save):
    """torch's file writer reports a full disk as a RuntimeError ('unexpected pos'), not ENOSPC, and DCP wraps it
    as a rank's failure (issue 44: 'a peer failing inside DCP'). With less room left than the checkpoint takes it is
    NoSpaceLeft, naming the size needed (the last checkpoint's) and the room there; with room, it stays a write
    error (not every failure is a full disk)."""
    saver = ckpt.Saver(async_save)
    _save(saver, tmp_path, 5)
    saver.wait()
    size = sum(f.stat().st_size for f in (tmp_path / "step_00000005").rglob("*") if f.is_file())

    def torn(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dcp_fs, "_write_item", torn)
    for free, error in [(size // 4, ckpt.NoSpaceLeft), (100 * size, ckpt.CheckpointWriteError)]:
        monkeypatch.setattr(saver_module.shutil, "disk_usage", lambda path, free=free: type("U", (), {"free": free}))
        with pytest.raises(ckpt.CheckpointWriteError) as raised:
            _save(saver, tmp_path, 10)
            saver.wait()
        assert type(raised.value) is error, raised.value
        if error is ckpt.NoSpaceLeft:
            assert f"needs ~{size / 2**20:.1f} MiB but {tmp_path} has {free / 2**20:.1f} MiB free" in str(raised.value)
        assert _steps(tmp_path) == [5] and not list(tmp_path.glob(".tmp-step_*"))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_commit_is_an_error_not_a_half_checkpoint(tmp_path, monkeypatch, async_save):
    """The shards were written, then the manifest could not be (the disk filled up in between)."""
    saver = ckpt.Saver(async_save)
    _save(saver, tmp_path, 5)
    saver.wait()
    monkeypatch.setattr(saver_module, "_write_durably", _no_space)  # where the commit looks it up
    with pytest.raises(ckpt.NoSpaceLeft, match=r"no space left on device: writing checkpoint .*step_00000010.*"
                       r"step_00000005"):
        _save(saver, tmp_path, 10)
        saver.wait()
    assert _steps(tmp_path) == [5] and not list(tmp_path.glob(".tmp-step_*"))
