"""Run ./pretrain.py as torchrun would (runpy), but on torchrun's first attempt rank FAULT_RANK raises a RuntimeError
at step FAULT_STEP, at the injection point FAULT_AT (a bug, a device error, a bad tensor; the process stays alive):

    forward     in the stage's forward of the step's first microbatch
    reduction   as the stage starts the step's gradient-norm all-reduce (pipeline/reduction.py)
    all_reduce  torch.distributed.all_reduce itself, at the first one issued after the engine reached FAULT_STEP
    checkpoint  in DCP's write of this rank's shard of the checkpoint of step FAULT_STEP

Just before raising it writes time.time() to $FAULT_MARK (bench/faults.py measures the exit from there)."""

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path.cwd()  # the checkout under test (torchrun runs there; bench/faults.py --repo may name another one)
sys.path.insert(0, str(ROOT))

import torch.distributed.checkpoint.filesystem as dcp_files

from asyncpp.parallel import flight
from asyncpp.pipeline import (
    engine,
    reduction,
)
from asyncpp.train.checkpoint import saver

AT, STEP = os.environ.get("FAULT_AT", "forward"), int(os.environ.get("FAULT_STEP", "5"))
MARK = os.environ.get("FAULT_MARK")
ARMED = (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and "FAULT_RANK" in os.environ
         and os.environ.get("RANK", "0") == os.environ["FAULT_RANK"]
         and not (MARK and Path(MARK).exists()))  # once: a launcher's own restart (slurm's script) runs clean


def fault(where: str) -> None:
    if MARK:
        Path(MARK).write_text(f"{time.time()}\n")
    raise RuntimeError(f"injected fault in {where} (rank {os.environ.get('RANK')}, step {STEP})")


def patch(owner, name: str, when) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if ARMED and when(*args, **kwargs):
            fault(f"{owner.__name__}.{name}")
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


if AT == "forward":
    patch(engine.StageEngine, "_forward", lambda self, a: a.step == STEP and a.microbatch == 0)
elif AT == "reduction":
    patch(reduction.GradientReduction, "_start_norm", lambda self, p: p.step == STEP)
elif AT == "checkpoint":
    saving = []  # the step of the checkpoint being written
    original_write = dcp_files._write_item
    patch(saver.Saver, "save", lambda self, root, step, *a, **k: saving.append(step) and False)

    def write_item(*args, **kwargs):
        if ARMED and saving and saving[-1] == STEP:
            fault("a checkpoint write (torch.distributed.checkpoint.filesystem._write_item)")
        return original_write(*args, **kwargs)

    dcp_files._write_item = write_item
elif AT == "all_reduce":  # the first all_reduce this rank issues once its engine runs an action of FAULT_STEP
    seen = []
    patch(engine.StageEngine, "_forward", lambda self, a: seen.append(a.step) and False)
    wrapped = flight._WRAPPERS["all_reduce"]  # what the run's flight recorder installs as torch.distributed's

    def all_reduce(*args, **kwargs):
        if ARMED and seen and seen[-1] >= STEP:
            fault("torch.distributed.all_reduce")
        return wrapped(*args, **kwargs)

    flight._WRAPPERS["all_reduce"] = all_reduce
else:
    raise SystemExit(f"FAULT_AT={AT}: choose forward, reduction or checkpoint")

if __name__ == "__main__":
    runpy.run_path(str(ROOT / "pretrain.py"), run_name="__main__")
