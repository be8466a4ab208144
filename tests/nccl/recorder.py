"""Record every torch.distributed operation a rank issues, in issue order (a test-only hook).

`record()` patches the public entry points of torch.distributed (both `torch.distributed.X` and the
`distributed_c10d.X` that torch's own helpers call) for the lifetime of a `with` block. Only the
outermost call is recorded: `all_gather_object` or `batch_isend_irecv` call `all_gather` / `isend`
themselves, and those inner calls belong to the outer operation. Each issued operation becomes one
`Op` entry; every wait on it (an explicit `Work.wait()`, or the implicit wait of a blocking call)
becomes a `Wait` entry, because a wait orders everything the rank issues after it behind that
operation: on the CPU by blocking the thread, on a GPU by making the compute stream wait.

Nothing in the library knows about this module: it is installed by the test workers only.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "monitored_barrier",
    "all_gather_single", "reduce_scatter_single",  # torch 2.13's names of all_gather_into_tensor / reduce_scatter_tensor
)
BLOCKING_P2P = ("send", "recv")


@dataclass(frozen=True)
class P2PPart:
    """One send or recv: `peer` is a global rank."""

    kind: str  # "send" | "recv"
    peer: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class Op:
    seq: int
    name: str  # the torch.distributed function: isend, batch_isend_irecv, all_reduce, ...
    group: str  # the process group's name (equal on every member)
    ranks: tuple[int, ...]  # its members, as global ranks
    parts: list[P2PPart] = field(default_factory=list)  # p2p ops (one, or a batch's)
    shape: tuple[int, ...] | None = None  # collectives: the first tensor argument
    dtype: str | None = None
    site: str = ""  # the innermost asyncpp/ frame that issued it (for reports)

    @property
    def is_p2p(self) -> bool:
        return bool(self.parts)

    @property
    def batched(self) -> bool:
        return self.name == "batch_isend_irecv"

    def describe(self) -> str:
        if self.parts:
            what = ", ".join(f"{p.kind} {'to' if p.kind == 'send' else 'from'} {p.peer} {list(p.shape)} {p.dtype}"
                             for p in self.parts)
        else:
            what = f"{list(self.shape) if self.shape is not None else ''} {self.dtype or ''}".strip()
        return f"#{self.seq} {self.name}({what}) on {list(self.ranks)} at {self.site}"


@dataclass(frozen=True)
class Wait:
    seq: int  # the Op waited for


class _WorkProxy:
    """A Work whose wait() is recorded; everything else goes to the real handle."""

    def __init__(self, work, seq: int, recorder: Recorder):
        self._work, self._seq, self._recorder = work, seq, recorder

    def wait(self, *args, **kwargs):
        self._recorder.log.append(Wait(self._seq))
        return self._work.wait(*args, **kwargs) if self._work is not None else True

    def __getattr__(self, name):
        return getattr(self._work, name)


def _group_of(group) -> tuple[str, tuple[int, ...]]:
    group = group if group is not None else c10d._get_default_group()
    return group.group_name, tuple(dist.get_process_group_ranks(group))


def _site() -> str:
    """The innermost asyncpp/ (or tests/dist/) frames of two files, e.g. engine.py:_forward>p2p.py:_send."""
    frame, names, files = sys._getframe(2), [], set()
    while frame is not None and len(files) < 2:
        path = frame.f_code.co_filename
        if (f"{os.sep}asyncpp{os.sep}" in path or f"{os.sep}tests{os.sep}dist{os.sep}" in path) and path not in files:
            names.append(f"{os.path.basename(path)}:{frame.f_code.co_name}")  # the innermost frame of each file
            files.add(path)
        frame = frame.f_back
    return ">".join(reversed(names)) or "?"


def _first_tensor(bound: inspect.BoundArguments):
    for value in bound.arguments.values():
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            return value
        if isinstance(value, (list, tuple)) and value and hasattr(value[0], "shape"):
            return value[0]
    return None


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Recorder:
    """The per-rank log of one run; install with `record()`."""

    def __init__(self) -> None:
        self.log: list[Op | Wait] = []
        self._depth = threading.local()

    def _issue(self, op: Op) -> int:
        op.seq = len([e for e in self.log if isinstance(e, Op)])
        self.log.append(op)
        return op.seq

    def _p2p_part(self, name: str, bound: inspect.BoundArguments) -> tuple[P2PPart, object]:
        args = bound.arguments
        tensor = args["tensor"]
        group = args.get("group")
        if name in ("isend", "send"):
            peer = args.get("dst")
            local = args.get("group_dst")
        else:
            peer = args.get("src")
            local = args.get("group_src")
        if peer is None and local is not None:
            peer = dist.get_global_rank(group if group is not None else c10d._get_default_group(), local)
        kind = "send" if name in ("isend", "send") else "recv"
        return P2PPart(kind, int(peer), tuple(tensor.shape), _dtype_name(tensor.dtype)), group

    def wrap(self, name: str, fn):
        signature = inspect.signature(fn)
        recorder = self

        def wrapper(*args, **kwargs):
            depth = getattr(recorder._depth, "value", 0)
            if depth:
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            site = _site()
            if name == "batch_isend_irecv":
                ops = bound.arguments["p2p_op_list"]
                parts = [P2PPart("send" if o.op in (dist.isend, c10d.isend, _ORIGINAL["isend"]) else "recv", o.peer,
                                 tuple(o.tensor.shape), _dtype_name(o.tensor.dtype)) for o in ops]
                group_name, ranks = _group_of(ops[0].group if ops else None)
                op = Op(0, name, group_name, ranks, parts, site=site)
            elif name in P2P:
                part, group = self._p2p_part(name, bound)
                group_name, ranks = _group_of(group)
                op = Op(0, name, group_name, ranks, [part], site=site)
            else:
                group_name, ranks = _group_of(bound.arguments.get("group"))
                tensor = _first_tensor(bound)
                op = Op(0, name, group_name, ranks, site=site,
                        shape=tuple(tensor.shape) if tensor is not None else None,
                        dtype=_dtype_name(tensor.dtype) if tensor is not None else None)
            seq = recorder._issue(op)
            recorder._depth.value = depth + 1
            try:
                result = fn(*args, **kwargs)
            finally:
                recorder._depth.value = depth
            if name == "batch_isend_irecv":
                return [_WorkProxy(w, seq, recorder) for w in result]
            if name in ("isend", "irecv") or bound.arguments.get("async_op"):
                return _WorkProxy(result, seq, recorder)
            recorder.log.append(Wait(seq))  # a blocking call: waited for before it returns
            return result

        wrapper.__wrapped__ = fn
        return wrapper


_ORIGINAL: dict[str, object] = {name: getattr(c10d, name) for name in (*P2P, *COLLECTIVES, "batch_isend_irecv")
                                if hasattr(c10d, name)}


@contextlib.contextmanager
def record() -> Iterator[Recorder]:
    """Patch torch.distributed for the block; yields the Recorder whose `.log` fills up."""
    recorder = Recorder()
    patched = {name: recorder.wrap(name, fn) for name, fn in _ORIGINAL.items()}
    for name, wrapper in patched.items():
        setattr(c10d, name, wrapper)
        if hasattr(dist, name):
            setattr(dist, name, wrapper)
    try:
        yield recorder
    finally:
        for name, fn in _ORIGINAL.items():
            setattr(c10d, name, fn)
            if hasattr(dist, name):
                setattr(dist, name, fn)
