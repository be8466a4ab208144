"""python -m tests.nccl [layout ...]: record layouts and print each one's replay (the first blocked
op of every rank on a deadlock), for lazy and eager communicators."""

from __future__ import annotations

import sys

from tests.nccl.layouts import LAYOUTS, record_layout
from tests.nccl.replay import MODES, replay


def main(names: list[str]) -> int:
    failed = 0
    for name in names or list(LAYOUTS):
        try:
            logs = record_layout(LAYOUTS[name])
        except RuntimeError as e:  # the run itself failed on gloo: show why, go on with the others
            failed += 1
            print(f"{name} did not run: {str(e)[-600:]}", flush=True)
            continue
        for mode in MODES:
            result = replay(logs, mode)
            failed += not result.ok
            print(f"{name} {result.summary()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
