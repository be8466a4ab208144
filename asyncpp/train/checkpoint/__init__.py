"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resharding, atomic, everything resume needs.

Layout-free keys: every tensor is saved under the parameter's name in the *full* model, so a
checkpoint written by a 2-stage pipeline loads into one process or a 4-stage pipeline (each rank
asks DCP for the keys it owns). A tied LM head is saved and loaded as `embed.weight`.

    weights/<age>/<name>      weight version x_{t-age} (age 0 = x_t, the newest; 2BW also needs age 1);
                              under bf16 age 0 is the fp32 master, saved by its owner (distributed optimizer)
    ef/<name>                 Error Feedback's u_{t-1} (and gef/<name>: gradient-level EF's g_{t-1})
    optim/<name>/<key>        the optimizer state of that parameter (momentum, exp_avg, step, ...)

Beside the DCP shards, `manifest.json` (written last, by rank 0) records the step, the resolved
config, the code version, the layout and every rank's RNG state. A checkpoint directory is written
under a temporary name and renamed when complete, so an interrupted save never shadows the last good
one; only directories with a manifest are ever loaded. A state with a non-finite
tensor is never written: save() refuses it on every rank before anything touches the disk, so pruning
(keep_last) never trades good checkpoints for a bad one.

One module per concern: files.py (the directory, lineage, keep_last), state.py (a StageState as DCP keys),
parts.py (an executor's Stateful parts assembled into a StageState, saved and resumed: one path for both executors),
saver.py (writing and committing), restore.py (choosing, checking and loading a checkpoint), rng.py (the
ranks' RNG states), runtime.py (the process group and DCP). This package re-exports what callers use.
"""

from asyncpp.train.checkpoint.files import (
    MANIFEST,
    TMP_PREFIX,
    checkpoint_root,
    clean_stale,
    is_complete,
    latest,
    list_checkpoints,
    prune,
    read_manifest,
    resume_target,
    step_of,
)
from asyncpp.train.checkpoint.parts import Checkpointer, StageParts
from asyncpp.train.checkpoint.restore import (
    check_data_position,
    damage,
    data_position,
    latest_intact,
    load,
    newest_weights,
    resume_point,
    saved_under,
)
from asyncpp.train.checkpoint.runtime import quiet_single_process_dcp
from asyncpp.train.checkpoint.saver import (
    FORMAT_VERSION,
    CheckpointWriteError,
    NonFiniteState,
    NoSpaceLeft,
    Saver,
    code_version,
    due,
    save,
)
from asyncpp.train.checkpoint.state import Shard, StageState, all_finite, nonfinite_tensors

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "TMP_PREFIX",
    "CheckpointWriteError",
    "Checkpointer",
    "NoSpaceLeft",
    "NonFiniteState",
    "Saver",
    "Shard",
    "StageParts",
    "StageState",
    "all_finite",
    "check_data_position",
    "checkpoint_root",
    "clean_stale",
    "code_version",
    "damage",
    "data_position",
    "due",
    "is_complete",
    "latest",
    "latest_intact",
    "list_checkpoints",
    "load",
    "newest_weights",
    "nonfinite_tensors",
    "prune",
    "quiet_single_process_dcp",
    "read_manifest",
    "resume_point",
    "resume_target",
    "save",
    "saved_under",
    "step_of",
]
