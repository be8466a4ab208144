"""The convention every piece of a checkpoint's state follows (torch.distributed.checkpoint.stateful.Stateful):

    state_dict()          the tensors themselves (not copies): a save writes them, a load fills them in place
    load_state_dict(sd)   take a loaded state: copy in what is not already the same storage, then restore what
                          follows from it (the parameters pointing at the newest version, the routers' bias)

The weight versions (the pipeline's WeightVersions, the simulator's VersionHistory), the update rule's buffers
(core/update.py) and the router-bias versions (core/balancing.py) follow it, so both executors' checkpoints are
assembled by one path (asyncpp/train/checkpoint/parts.py). Not imported from torch here: DCP's package costs
every process half a second and 46 MB at import (asyncpp/train/checkpoint/runtime.py), and a Protocol matches by
shape; tests/unit/test_checkpoint_parts.py checks each piece against torch's own Stateful.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


@torch.no_grad()
def load_in_place(dst: Sequence[Tensor], src: Sequence[Tensor | None]) -> None:
    """dst[i] takes src[i]'s values, unless src[i] is None or already dst[i]'s storage (a load into state_dict()'s
    own tensors, or a detached view of them)."""
    for d, s in zip(dst, src):
        if s is not None and (s.data_ptr() != d.data_ptr() or s.shape != d.shape):
            d.copy_(s)
