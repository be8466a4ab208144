"""Record every torch.distributed operation a rank issues, in issue order: the library's flight recorder
(asyncpp/parallel/flight.py), unbounded.

Each issued operation becomes one `Op` entry; every wait on it (an explicit `Work.wait()`, or the implicit wait of
a blocking call) becomes a `Wait` entry, because a wait orders everything the rank issues after it behind that
operation: on the CPU by blocking the thread, on a GPU by making the compute stream wait. A run keeps the last
flight.CAPACITY entries for its hang reports; the replay needs them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from asyncpp.parallel.flight import Op, P2PPart, Recorder, Wait, recording

__all__ = ["Op", "P2PPart", "Recorder", "Wait", "record"]


@contextlib.contextmanager
def record() -> Iterator[Recorder]:
    """Patch torch.distributed for the block; yields the Recorder whose `.log` fills up (every entry kept)."""
    with recording(capacity=None) as recorder:
        yield recorder
