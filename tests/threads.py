"""torch at one intra-op thread for a block, restored after (also when the block raises).

Used where floats are compared bit for bit across processes (CPU matmuls block differently with more
threads) and where several processes share the 2 cores (OpenMP's spinning barriers then cost seconds).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
