"""The flight recorder: each rank's recent torch.distributed ops, written to the run directory when a wait gives up.

When a rank hangs, its neighbours give up after train.timeout_s (collectives.timeout_message, the one wording of
those errors). The message names the stage and the op it waited for; this module adds the evidence behind it: the
rank's last CAPACITY entries, each op with its kind, group, peer or members, shape, dtype, the call site, what the
project called it ("the input activation of F8.1@v8 from rank 0"), when it was issued and whether it completed.
Every rank that gives up writes its own file, so an operator reads off which rank waited for what.

Why not torch's own flight recorder: on gloo (torch 2.13, TORCH_FR_BUFFER_SIZE, `_dump_fr_trace_json`) it records
collectives only, no isend/irecv, which is how pipeline stages talk, and every entry stays "scheduled": gloo never
reports a start or a completion to it. (Checked with a 2-rank gloo job: an all-reduce, an isend/irecv pair and a
hung all-reduce gave three "scheduled" all-reduce entries and no p2p entry.) On NCCL it is the better tool; nothing
here stops a job from enabling it as well.

How: `recording()` patches the public entry points of torch.distributed (both `torch.distributed.X` and the
`distributed_c10d.X` torch's own helpers call) for the lifetime of a `with` block. Only the outermost call is
recorded: `all_gather_object` or `batch_isend_irecv` call `all_gather` / `isend` themselves, and those inner calls
belong to the outer operation. Each issued operation becomes one `Op`; every wait on it (an explicit `Work.wait()`,
or the implicit wait of a blocking call) becomes a `Wait` entry and moves the Op's `state`. The same log, unbounded,
is what the NCCL-order replay (tests/nccl) reads: a wait orders everything the rank issues after it behind that
operation. Cost: one small object and one deque append per op, plus naming its arguments, its group and its call
site: 6 to 7 µs per op on the 2-core development machine at load 10 (against a no-op torch.distributed function;
a 1-rank gloo all-reduce itself took 11 to 15 µs there), i.e. well under 0.1 ms for the ~10 ops a stage of the tiny
2-stage pipeline issues per step, a step of hundreds of milliseconds.

A run (asyncpp/job.py) records for its whole life with `dump_dir=<run dir>/comm_ops` (DUMP_DIR); a signal that asks the run
to stop also writes the file (train/preemption.py), so a preempted rank shows what it had in flight.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

DUMP_DIR = "comm_ops"
"""A run's files, one per rank and dump, go to <run dir>/comm_ops/rank<R>-<UTC time>.json."""

CAPACITY = 2000
"""Entries a run keeps (ops and waits; torch's flight recorder keeps 2000 too): a few steps of a deep pipeline."""

P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "monitored_barrier",
    "all_gather_single", "reduce_scatter_single",  # torch 2.13's names of all_gather_into_tensor / reduce_scatter_tensor
)
BLOCKING = frozenset(n for n in (*P2P, *COLLECTIVES) if n not in ("isend", "irecv"))
"""Calls that wait before they return unless given async_op=True (then `waited` is set by the Work's wait)."""
SITE_DIRS = (f"{os.sep}asyncpp{os.sep}", f"{os.sep}tests{os.sep}dist{os.sep}")
"""Frames that name an op's call site (the test workers' own ops, in tests/dist, are named too)."""


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
    site: str = ""  # the innermost asyncpp/ frames that issued it (for reports)
    what: str = ""  # what the project calls it at its issue (`about`: the error a failed issue would name)
    waited_as: str = ""  # what the wait on it calls it (`note_wait`: "the input activation of F8.1@v8 from rank 0")
    issued: float = 0.0  # time.time() at its issue
    state: str = "issued"  # issued -> waiting -> completed | failed (a send polled complete skips waiting)
    waited: float | None = None  # time.time() when this rank first waited for it (a blocking call: at its issue)
    settled: float | None = None  # time.time() when it completed or failed

    @property
    def is_p2p(self) -> bool:
        return bool(self.parts)

    @property
    def batched(self) -> bool:
        return self.name == "batch_isend_irecv"

    @property
    def pending(self) -> bool:
        return self.state != "completed"

    def describe(self) -> str:
        if self.parts:
            what = ", ".join(f"{p.kind} {'to' if p.kind == 'send' else 'from'} {p.peer} {list(p.shape)} {p.dtype}"
                             for p in self.parts)
        else:
            what = f"{list(self.shape) if self.shape is not None else ''} {self.dtype or ''}".strip()
        return f"#{self.seq} {self.name}({what}) on {list(self.ranks)} at {self.site}"

    def _settle(self, state: str) -> None:
        self.state, self.settled = state, time.time()


@dataclass(frozen=True)
class Wait:
    seq: int  # the Op waited for


class _WorkProxy:
    """A Work whose wait() and completion are recorded; everything else goes to the real handle."""

    def __init__(self, work, op: Op, recorder: Recorder):
        self._work, self.flight_op, self._recorder = work, op, recorder

    def wait(self, *args, **kwargs):
        op = self.flight_op
        self._recorder.log.append(Wait(op.seq))
        if op.state == "issued":
            op.state, op.waited = "waiting", time.time()
        try:
            done = self._work.wait(*args, **kwargs) if self._work is not None else True
        except BaseException:
            op._settle("failed")
            raise
        op._settle("completed")
        return done

    def is_completed(self) -> bool:
        done = self._work.is_completed() if self._work is not None else True
        if done and self.flight_op.state != "completed":
            self.flight_op._settle("completed")
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _site() -> str:
    """The innermost asyncpp/ (or tests/dist/) frames of two files, e.g. engine.py:_forward>p2p.py:_send."""
    frame, names, files = sys._getframe(1), [], {__file__}
    while frame is not None and len(files) < 3:
        path = frame.f_code.co_filename
        if path not in files and any(d in path for d in SITE_DIRS):
            names.append(f"{os.path.basename(path)}:{frame.f_code.co_name}")  # the innermost frame of each file
            files.add(path)
        frame = frame.f_back
    return ">".join(reversed(names)) or "?"


def _first_tensor(args: dict):
    for value in args.values():
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            return value
        if isinstance(value, (list, tuple)) and value and hasattr(value[0], "shape"):
            return value[0]
    return None


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Recorder:
    """One rank's log: the last `capacity` entries (None: all of them, as the NCCL replay needs). Install with
    `recording()`; `dump` writes it to `dump_dir`."""

    def __init__(self, capacity: int | None = CAPACITY, dump_dir: str | Path | None = None) -> None:
        self.log: deque[Op | Wait] = deque(maxlen=capacity)
        self.capacity = capacity
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self._seq = itertools.count()
        self._local = threading.local()  # per thread: the wrapper's nesting depth, the current label
        self._groups: dict[int, tuple[object, str, tuple[int, ...]]] = {}

    def _issue(self, op: Op) -> int:
        op.seq = next(self._seq)
        op.issued = time.time()
        if op.name in BLOCKING:  # it waits from its issue (call() takes that back for async_op=True)
            op.state, op.waited = "waiting", op.issued
        op.what = getattr(self._local, "label", None) or ""
        self.log.append(op)
        return op.seq

    def _group_of(self, group) -> tuple[str, tuple[int, ...]]:
        """(name, global ranks) of a group, cached: torch's lookup of a group's ranks walks a table."""
        group = group if group is not None else c10d._get_default_group()
        known = self._groups.get(id(group))
        if known is None or known[0] is not group:
            known = self._groups[id(group)] = (group, group.group_name, tuple(dist.get_process_group_ranks(group)))
        return known[1], known[2]

    def _p2p_part(self, name: str, args: dict) -> tuple[P2PPart, object]:
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

    def _op(self, name: str, args: dict) -> Op:
        site = _site()
        if name == "batch_isend_irecv":
            ops = args["p2p_op_list"]
            parts = [P2PPart("send" if o.op in (dist.isend, c10d.isend, _ORIGINAL["isend"]) else "recv", o.peer,
                             tuple(o.tensor.shape), _dtype_name(o.tensor.dtype)) for o in ops]
            group_name, ranks = self._group_of(ops[0].group if ops else None)
            return Op(0, name, group_name, ranks, parts, site=site)
        if name in P2P:
            part, group = self._p2p_part(name, args)
            group_name, ranks = self._group_of(group)
            return Op(0, name, group_name, ranks, [part], site=site)
        group_name, ranks = self._group_of(args.get("group"))
        tensor = _first_tensor(args)
        return Op(0, name, group_name, ranks, site=site, shape=tuple(tensor.shape) if tensor is not None else None,
                  dtype=_dtype_name(tensor.dtype) if tensor is not None else None)

    def call(self, name: str, fn, params: tuple[str, ...], args, kwargs):
        """Issue `fn` (torch.distributed's `name`, whose parameters are `params`) and record it."""
        depth = getattr(self._local, "depth", 0)
        if depth:
            return fn(*args, **kwargs)
        arguments = dict(zip(params, args))  # what inspect's bind gives, at a tenth of its cost; defaults unset
        arguments.update(kwargs)
        op = self._op(name, arguments)
        self._issue(op)
        self._local.depth = depth + 1
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            op._settle("failed")
            raise
        finally:
            self._local.depth = depth
        if name == "batch_isend_irecv":
            return [_WorkProxy(w, op, self) for w in result]
        if name in ("isend", "irecv") or arguments.get("async_op"):
            op.state, op.waited = "issued", None
            return _WorkProxy(result, op, self)
        self.log.append(Wait(op.seq))  # a blocking call: waited for before it returns
        op._settle("completed")
        return result

    # ---- the dump --------------------------------------------------------------------------------
    def entries(self) -> list[dict]:
        """The log as plain records, oldest first (an op's state is its state now)."""
        out = []
        for e in list(self.log):  # a copy: list() of a deque runs under the GIL, other threads keep appending
            if isinstance(e, Wait):
                out.append({"wait": e.seq})
                continue
            record = asdict(e)
            record["parts"] = [asdict(p) for p in e.parts]
            out.append(record)
        return out

    def dump(self, reason: str, where: str = "", groups: dict[str, str] | None = None) -> Path | None:
        """Write the log to `<dump_dir>/rank<R>-<UTC time>.json` (None without a dump_dir). `groups` names the
        process groups (group_name -> what the job uses it for). Raises OSError if the file cannot be written."""
        if self.dump_dir is None:
            return None
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        now = time.time()
        entries = self.entries()
        ops = [e for e in entries if "wait" not in e]
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}"
        body = {
            "rank": rank, "where": where, "reason": reason, "host": socket.gethostname(), "pid": os.getpid(),
            "written": now, "capacity": self.capacity, "groups": groups or {},
            "pending": [_line(e, now, groups or {}) for e in sorted(
                (e for e in ops if e["state"] != "completed"), key=lambda e: (STATES.index(e["state"]), e["seq"]))],
            "entries": entries,
        }
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"rank{rank}-{stamp}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(path)  # a reader never sees half a file
        return path


STATES = ("failed", "waiting", "issued", "completed")
"""An op's states, in the order a dump lists the pending ones: what this rank gave up on, what its threads wait
for, then what it issued and has not waited for yet (an isend on gloo reports completion only to a wait)."""


def _line(e: dict, now: float, groups: dict[str, str]) -> str:
    """One op as an operator reads it: '#16 irecv(recv from 0 [2, 16, 128] float32) on the pipeline link
    (recv_forward) group (ranks [0, 1]): failed after waiting 10.0 s, issued 10.0 s before this dump, the input
    activation of F2.1@v1 from rank 0, the next forward receive from rank 0 (posting it), at
    engine.py:_post_receive>p2p.py:_post'."""
    if e["parts"]:
        what = ", ".join(f"{p['kind']} {'to' if p['kind'] == 'send' else 'from'} {p['peer']} {list(p['shape'])} "
                         f"{p['dtype']}" for p in e["parts"])
    else:
        what = f"{list(e['shape']) if e['shape'] is not None else ''} {e['dtype'] or ''}".strip()
    group = groups.get(e["group"], f"ranks {list(e['ranks'])}")
    state = e["state"]
    if e["waited"] is not None:
        waited = (e["settled"] or now) - e["waited"]
        state = f"waiting for {waited:.1f} s" if state == "waiting" else f"{state} after waiting {waited:.1f} s"
    elif state == "issued":
        state = "not waited for yet"
    labels = "".join(f", {text}" for text in dict.fromkeys((e["waited_as"], e["what"])) if text)
    return (f"#{e['seq']} {e['name']}({what}) on {group}: {state}, issued {now - e['issued']:.1f} s before this "
            f"dump{labels}, at {e['site']}")


_STACK: list[Recorder] = []
"""The installed recorders, innermost last: the wrappers record into the innermost (a test's unbounded one inside a
run's)."""


def current() -> Recorder | None:
    return _STACK[-1] if _STACK else None


def _wrap(name: str, fn):
    params = tuple(inspect.signature(fn).parameters)

    def wrapper(*args, **kwargs):
        recorder = current()
        if recorder is None:
            return fn(*args, **kwargs)
        return recorder.call(name, fn, params, args, kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


_ORIGINAL: dict[str, object] = {name: getattr(c10d, name) for name in (*P2P, *COLLECTIVES, "batch_isend_irecv")
                                if hasattr(c10d, name)}
_WRAPPERS = {name: _wrap(name, fn) for name, fn in _ORIGINAL.items()}


def _patch(table: dict[str, object]) -> None:
    for name, fn in table.items():
        setattr(c10d, name, fn)
        if hasattr(dist, name):
            setattr(dist, name, fn)


@contextlib.contextmanager
def recording(capacity: int | None = CAPACITY, dump_dir: str | Path | None = None) -> Iterator[Recorder]:
    """Record this process's torch.distributed ops for the block; yields the Recorder (`.log` fills up, `.dump_dir`
    may be set later, once the run directory is known)."""
    recorder = Recorder(capacity, dump_dir)
    if not _STACK:
        _patch(_WRAPPERS)
    _STACK.append(recorder)
    try:
        yield recorder
    finally:
        _STACK.remove(recorder)
        if not _STACK:
            _patch(_ORIGINAL)


class about:
    """`with about("the loss all-reduce"):` labels the ops this thread issues in the block (a no-op when nothing
    records): what the error of a blocking call would name, for its entry in the log."""

    __slots__ = ("_label", "_local", "_previous")

    def __init__(self, label: str) -> None:
        self._label = label

    def __enter__(self) -> None:
        recorder = current()
        self._local = recorder._local if recorder is not None else None
        if self._local is not None:
            self._previous = getattr(self._local, "label", None)
            self._local.label = self._label

    def __exit__(self, *exc) -> None:
        if self._local is not None:
            self._local.label = self._previous


def note_wait(work, what: str) -> None:
    """The op behind `work` is now waited for as `what` (p2p.StageComm's waits name the action): its log entry
    records that name too."""
    op = getattr(work, "flight_op", None)
    if op is not None:
        op.waited_as = what


def dump(reason: str, where: str = "", groups: dict[str, str] | None = None) -> str:
    """Write the current recorder's log (Recorder.dump) and say where, as the end of a sentence that begins "this
    rank's recent communication ops": "are in <file>", "could not be written to <dir>: <error>", or "" when nothing
    records. Never raises: it runs while another error is being reported, which matters more."""
    recorder = current()
    if recorder is None or recorder.dump_dir is None:
        return ""
    try:
        return f"are in {recorder.dump(reason, where, groups)}"
    except (OSError, RuntimeError, ValueError) as e:
        return f"could not be written to {recorder.dump_dir}: {e}"
