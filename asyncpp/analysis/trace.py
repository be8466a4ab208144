"""A dispatch mode that watches one training step op by op: live storage bytes, host reads, communication.

Every ATen op of the step passes through `StepTracer.__torch_dispatch__` (forward, autograd's backward, the
optimizer, the reductions; c10d's collectives and p2p ops are dispatcher ops too). It keeps:

- **live storage bytes**: every storage an op returns is entered in a ledger with a weak reference to it
  (torch's StorageWeakRef: it sees the storage itself die, also when only autograd's saved tensors held it,
  and a storage shared by views counts once). The tensors alive when the trace starts (weights, versions,
  masters, optimizer state, Error Feedback) are entered then. The peak is kept per action, between the
  action boundaries the caller marks. Expired storages are swept at every boundary and whenever the bytes
  entered since the last sweep exceed `sweep_fraction` of the peak so far: between sweeps the live count
  can only be too high, by less than that fraction (a sweep per op would cost the step's ops times the
  live storages).
- **host reads**: `aten._local_scalar_dense` (`.item()`, `float()`, `int()`, `bool()` of a tensor), copies from a
  device tensor to the CPU (`.tolist()`, `.cpu()`), and the ops whose output size depends on the values
  (nonzero, masked_select, unique, bincount, repeat_interleave without output_size), each with the first
  call site in the project's code. On CUDA each of these makes the host wait for the device.
- **communication**: every c10d op (collectives, send/recv, all-to-all) with its tensors' shapes and dtypes.

On the meta device a host read has no value to return, so the tracer returns a stand-in (`StandIns`): a replay
of the values a real run of the same step read (the tests), or fixed values otherwise (True for a bool, 0.0
for a float: finite, so the update takes its ordinary path, and below any clipping threshold, so the gradient is
not rescaled, an in-place multiply that allocates nothing; the integer stand-ins are the caller's, e.g. the
rows per expert of a balanced router).
"""

from __future__ import annotations

import gc
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

_ROOT = Path(__file__).resolve().parents[2]
_PROJECT = tuple(str(_ROOT / top) + "/" for top in ("asyncpp", "model_zoo", "data"))
_TRACERS = str(Path(__file__).resolve().parent) + "/"  # asyncpp/analysis/: the tracers' own frames are no call site
_PLUMBING = ("/torch/utils/_python_dispatch", "/torch/_ops", "/torch/_dynamo/", "/torch/_compile", "/torch/overrides",
             "/torch/_tensor.py", "/torch/utils/_contextlib")

aten = torch.ops.aten
SCALAR_READ = aten._local_scalar_dense.default
DATA_DEPENDENT = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
                  "aten::unique_consecutive", "aten::bincount", "aten::nonzero_static"}
"""Ops whose output size is computed from the values (on CUDA: a device-to-host read to size the output)."""
COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


NEEDED = {
    ("asyncpp/parallel/experts.py", "dispatch"): "the expert all-to-all's split sizes: NCCL takes them on the host",
    ("asyncpp/pipeline/update.py", "apply"): "the global norm: the skip decision and the clip coefficient are "
                                             "taken on the host, once per step",
    ("asyncpp/core/update.py", "_restore_if_not_finite"): "whether x_{t+1} is finite: the contract skips a "
                                                           "non-finite update on every stage, and the host decides "
                                                           "the restore, the router bias and the stop before the "
                                                           "next forward reads x_{t+1}",
    ("asyncpp/pipeline/parts.py", "evaluation_output"): "the validation loss of the whole head (evaluation only)",
    ("asyncpp/pipeline/vocab_head.py", "evaluate"): "the validation loss of the vocabulary-parallel head (evaluation "
                                                    "only)",
    ("asyncpp/pipeline/reduction.py", "all_reduce_norms"): "the last update norms at a drain (once per segment)",
}
"""Host reads the step needs, by (file, function) of their call site, with the reason. Every other is a sync
that could go (docs/gpu.md's table)."""


def needed(site: str) -> str:
    """The reason a read at `site` is needed, or "" if it is not."""
    path, _, rest = site.partition(":")
    function = rest.partition("(")[2].partition(")")[0]
    return NEEDED.get((path, function), "")


@dataclass(frozen=True)
class HostRead:
    kind: str
    """'scalar' (.item(), float(), bool()), 'copy to host' (.tolist(), .cpu()), 'copy from host' (a pageable
    host-to-device copy: torch.tensor(list, device=...)) or 'data-dependent size'."""
    op: str
    site: str
    """The first call site in the project's code: path:line (function)."""
    action: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "op": self.op, "site": self.site, "action": self.action,
                "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class CommOp:
    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    action: str
    site: str

    def to_dict(self) -> dict:
        return {"op": self.op, "shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes),
                "action": self.action, "site": self.site}


@dataclass
class ActionMemory:
    action: str
    peak_bytes: int
    """The most live storage bytes seen during the action (an upper bound by < sweep_fraction of the peak)."""
    live_bytes: int
    """Live bytes at its end (exact: swept)."""


@dataclass
class StandIns:
    """What a host read returns on the meta device, which has no values."""

    replay: list | None = None
    """The scalars a real run of the same step read, in order (StepTracer(record=True).scalars)."""
    ints: dict[str, int] = field(default_factory=dict)
    """An integer read at a call site starting with the key (a path): e.g. the expert all-to-all's split sizes
    in asyncpp/parallel/experts.py, the busiest expert's rows that size the padded-bmm buffer in
    model_zoo/moe.py. By site, not by op: a .tolist() is one copy to the host on meta but one read per
    element on FakeTensorMode's tensors. Elsewhere 1."""

    def __post_init__(self):
        self._replay = deque(self.replay or ())

    def _int(self, site: str) -> int:
        return next((v for prefix, v in self.ints.items() if site.startswith(prefix)), 1)

    def scalar(self, dtype: torch.dtype, site: str):
        if self._replay:
            return self._replay.popleft()
        if dtype == torch.bool:
            return True
        return 0.0 if dtype.is_floating_point or dtype.is_complex else self._int(site)

    def host_copy(self, shape, dtype: torch.dtype, site: str) -> torch.Tensor:
        value = True if dtype == torch.bool else (0.0 if dtype.is_floating_point else self._int(site))
        return torch.full(tuple(shape), value, dtype=dtype)


def without_values(x: torch.Tensor) -> bool:
    """A meta tensor or a FakeTensorMode tensor: shapes only, nothing to read."""
    return x.device.type == "meta" or is_fake(x)


def call_site() -> str:
    """The innermost frame in the project's code outside asyncpp/analysis/: where the host read was asked for; and,
    when the read itself happens in a library below it (torch.optim, say), that library's frame."""
    frame, via = sys._getframe(1), None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PROJECT) and not name.startswith(_TRACERS):
            site = f"{Path(name).relative_to(_ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
            return site + (f" via {via}" if via else "")
        if via is None and not name.startswith(_TRACERS) and not any(skip in name for skip in _PLUMBING):
            parts = Path(name).parts
            short = "/".join(parts[parts.index("torch"):]) if "torch" in parts else Path(name).name
            via = f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "outside the project" + (f" via {via}" if via else "")


class StorageLedger:
    """Live storages of one device type, by their StorageImpl, with a weak reference each."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live_bytes = 0  # exact at the last sweep, plus what was entered since

    def enter(self, t: torch.Tensor) -> int:
        """Enter t's storage if it is new (or grew); returns the bytes added."""
        if t.device.type != self.device_type or t.is_sparse:
            return 0
        s = t.untyped_storage()
        key, nbytes = s._cdata, s.nbytes()
        known = self._live.get(key)
        if known is not None and not known[0].expired():
            if nbytes == known[1]:
                return 0
            self._live[key] = (known[0], nbytes)  # resized in place
            self.live_bytes += nbytes - known[1]
            return max(nbytes - known[1], 0)
        if known is not None:  # an expired storage's address reused
            self.live_bytes -= known[1]
        self._live[key] = (StorageWeakRef(s), nbytes)
        self.live_bytes += nbytes
        return nbytes

    def sweep(self) -> int:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.live_bytes -= self._live.pop(k)[1]
        return self.live_bytes

    def enter_existing(self) -> int:
        """Every tensor alive now (the garbage collector's view: weights, versions, optimizer state). Collected
        first: an earlier stage's tensors in unreachable cycles would still be listed, and counted."""
        gc.collect()
        for obj in gc.get_objects():
            # Not a FakeTensor: torch.compile keeps those in its caches, they hold no memory, and once a graph
            # is dynamic their sizes are symbols (a sum with one made the tracer's peak a SymInt).
            if isinstance(obj, torch.Tensor) and not is_fake(obj):
                self.enter(obj)
        return self.sweep()


class StepTracer(TorchDispatchMode):
    """Records a step's ops, host reads, communication and (on `device_type`) live storage bytes per action.

    record=True (a real run): the scalars the host reads are kept in `scalars`, for a meta run to replay."""

    def __init__(self, device_type: str = "meta", stand_ins: StandIns | None = None, record: bool = False,
                 sweep_fraction: float = 0.005):
        super().__init__()
        self.ledger = StorageLedger(device_type)
        self.stand_ins = stand_ins if stand_ins is not None else StandIns()
        self.record = record
        self.sweep_fraction = sweep_fraction
        self.ops: list[str] = []
        self.op_actions: list[str] = []
        self.host_reads: list[HostRead] = []
        self.comms: list[CommOp] = []
        self.actions: list[ActionMemory] = []
        self.scalars: list = []
        self.host_copies: set[int] = set()  # indices in `ops` of the copies between host and device
        self.action = "start"
        self.peak_bytes = 0
        self.cyclic_bytes = 0
        self._action_peak = 0
        self._unswept = 0

    # ---- the caller's marks ----------------------------------------------------------------------------
    def start(self) -> int:
        """Enter what is alive now; call before entering the mode."""
        live = self.ledger.enter_existing()
        self.peak_bytes = self._action_peak = live
        return live

    def begin(self, action: str) -> None:
        self.ledger.sweep()
        self._unswept = 0
        self.action = action
        self._action_peak = self.ledger.live_bytes

    def end(self) -> None:
        """Close the action. The garbage collector runs here: storages held only by reference cycles are freed
        at a point that is the same in every run (Python's own collections come when its object counts say,
        which differ between a meta and a CPU run, and between a test process and a script), and what it
        freed is kept in `cyclic_bytes`: memory a run holds until a collection happens to come."""
        held = self.ledger.sweep()
        gc.collect()
        live = self.ledger.sweep()
        self.cyclic_bytes = max(self.cyclic_bytes, held - live)
        self._unswept = 0
        self.actions.append(ActionMemory(self.action, self._action_peak, live))
        self.action = "between actions"
        self._action_peak = live

    # ---- the mode ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        self.ops.append(name)
        self.op_actions.append(self.action)
        if func is SCALAR_READ:
            # Every scalar read, a CPU tensor's too, is one entry of the replay: a real CPU run reads all of
            # them from CPU tensors, and its order is the meta run's. Only a device tensor's is a host read.
            x = args[0]
            if x.device.type != "cpu":
                self._host_read("scalar", name, x)
            site = self.host_reads[-1].site if x.device.type != "cpu" else ""
            stand_in = self.stand_ins.scalar(x.dtype, site) if self.ledger.device_type != "cpu" else None
            if without_values(x):
                return stand_in
            value = func(*args, **kwargs)
            if self.record:
                self.scalars.append(value)
            return value
        if self._copies_to_host(func, args, kwargs):
            x = args[0] if func is not aten.copy_.default else args[1]
            self._host_read("copy to host", name, x)
            self.host_copies.add(len(self.ops) - 1)
            if without_values(x):
                dtype = kwargs.get("dtype") or x.dtype
                with _disable_current_modes():  # a real CPU tensor, also under an outer FakeTensorMode
                    copy = self.stand_ins.host_copy(x.shape, dtype, self.host_reads[-1].site)
                return args[0].copy_(copy) if func is aten.copy_.default else copy
        elif self._copies_from_host(func, args, kwargs):
            # A pageable host-to-device copy (torch.tensor(list, device=...), .to(device)): on CUDA the host
            # waits for the stream before it returns. torch.tensor() on the CPU runs lift_fresh instead.
            self._host_read("copy from host", name, args[0] if func is not aten.copy_.default else args[1])
            self.host_copies.add(len(self.ops) - 1)
        elif func is aten.lift_fresh.default:
            self.host_copies.add(len(self.ops) - 1)
        elif self._data_dependent(func, kwargs):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and first.device.type != "cpu":
                self._host_read("data-dependent size", name, first)
                if without_values(first):  # no values to size the output from: name the site
                    raise RuntimeError(f"{name} at {self.host_reads[-1].site} sizes its output from the values "
                                       "(a host sync on CUDA, and no size at all on meta): give it its size "
                                       "(output_size=, a static bound) if the host knows it")
        if func.namespace in COMM_NAMESPACES:
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            self.comms.append(CommOp(name, tuple(tuple(t.shape) for t in tensors),
                                     tuple(str(t.dtype).removeprefix("torch.") for t in tensors), self.action,
                                     call_site()))
        out = func(*args, **kwargs)
        self._enter_outputs(out)
        return out

    @staticmethod
    def _data_dependent(func, kwargs) -> bool:
        packet = func.overloadpacket._qualified_op_name
        if packet == "aten::repeat_interleave":  # tensor repeats without output_size: the sum is read
            return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
        return packet in DATA_DEPENDENT

    def _copies_to_host(self, func, args, kwargs) -> bool:
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            return (target is not None and torch.device(target).type == "cpu"
                    and args[0].device.type != "cpu")
        if func is aten.copy_.default:
            return args[0].device.type == "cpu" and args[1].device.type != "cpu"
        return False

    @staticmethod
    def _copies_from_host(func, args, kwargs) -> bool:
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            return (target is not None and torch.device(target).type != "cpu" and args[0].device.type == "cpu"
                    and not args[0].is_pinned())
        if func is aten.copy_.default:
            return args[0].device.type != "cpu" and args[1].device.type == "cpu" and not args[1].is_pinned()
        return False

    def note_host_read(self, kind: str, op: str, x: torch.Tensor) -> None:
        """A host read seen outside the dispatcher (AttentionPath's function mode)."""
        self._host_read(kind, op, x)

    def _host_read(self, kind: str, op: str, x: torch.Tensor) -> None:
        self.host_reads.append(HostRead(kind, op, call_site(), self.action, tuple(x.shape),
                                        str(x.dtype).removeprefix("torch.")))

    def _enter_outputs(self, out) -> None:
        added = 0
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                added += self.ledger.enter(t)
        if not added:
            return
        self._unswept += added
        if self._unswept > self.sweep_fraction * max(self.peak_bytes, 1):
            self.ledger.sweep()
            self._unswept = 0
        live = self.ledger.live_bytes
        self._action_peak = max(self._action_peak, live)
        self.peak_bytes = max(self.peak_bytes, live)


class AttentionPath(TorchFunctionMode):
    """F.scaled_dot_product_attention on meta (or fake) tensors runs the kernel of the device the trace stands for.

    SDPA picks its backend by the device: on meta it falls back to the math path, which saves the whole
    [B, H, T, T] attention matrix (512 MiB per layer at 16 heads x 4096 tokens): no GPU or CPU run keeps it.
    On fake CUDA tensors it picks math too ("flash attention requires a CUDA device, which is not available":
    the choice reads the GPU's properties).
    Here a causal SDPA without mask or dropout on meta calls the fused kernel instead: `gpu=True` CUDA's flash
    attention (bf16/fp16; GQA natively), else the CPU's flash kernel (what torch's CPU build picks), both with
    their autograd formulas and meta shapes. `chosen` counts the calls per path."""

    def __init__(self, gpu: bool, tracer: StepTracer | None = None):
        """tracer: told of every torch.tensor(data, device=<not the CPU>), a pageable host-to-device copy that
        no dispatch mode sees (torch builds it below the Python dispatch key)."""
        super().__init__()
        self.gpu, self.tracer = gpu, tracer
        self.chosen: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and self.tracer is not None:
            out = func(*args, **kwargs)
            if out.device.type != "cpu" and not isinstance(args[0] if args else None, torch.Tensor):
                self.tracer.note_host_read("copy from host", f"{func.__name__}(data, device=...)", out)
            return out
        if func is not F.scaled_dot_product_attention or not args or not without_values(args[0]):
            return func(*args, **kwargs)
        q, k, v = args[:3]
        plain = (len(args) <= 3 and kwargs.get("attn_mask") is None and not kwargs.get("dropout_p")
                 and kwargs.get("scale") is None)
        if not plain:
            self._count("math (mask, dropout or scale given)")
            return func(*args, **kwargs)
        causal = bool(kwargs.get("is_causal", False))
        if self.gpu and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
            self._count("flash (CUDA)")
            return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
        self._count("flash (CPU)" if not self.gpu else f"flash (CPU kernel: {q.dtype} is not CUDA flash's)")
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[0]

    def _count(self, path: str) -> None:
        self.chosen[path] = self.chosen.get(path, 0) + 1
