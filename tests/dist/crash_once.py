"""Run pretrain.py as torchrun would (runpy: the entry script is not a module anyone imports), but on torchrun's first attempt rank CRASH_RANK dies at step CRASH_STEP (a lost node)."""

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import asyncpp.pipeline.engine as engine  # noqa: E402

_forward = engine.StageEngine._forward


def forward(self, action):
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and os.environ["RANK"] == os.environ["CRASH_RANK"] and action.step == int(os.environ["CRASH_STEP"]):
        os._exit(9)  # no cleanup, like a node that lost power
    return _forward(self, action)


engine.StageEngine._forward = forward

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "pretrain.py"), run_name="__main__")
