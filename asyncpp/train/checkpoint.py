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
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-step_"
FORMAT_VERSION = 1


class NonFiniteState(ValueError):
    """A checkpoint was refused because a tensor of the state is NaN or infinite (raised on every rank)."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (a full disk, a read-only directory); nothing was committed."""


@dataclass
class StageState:
    """What one rank contributes to a checkpoint (and receives on load), by full-model name."""

    names: list[str]
    versions: dict[int, list[Tensor]]
    """age -> tensors in `names` order; written in place on load."""
    buffers: dict[str, list[Tensor | None]]
    """Per-parameter state besides weights and optimizer: {"ef": u_{t-1}, "gef": g_{t-1}}. None where another
    rank holds it (the distributed optimizer: the parameter's owner saves it, under the same key)."""
    optimizer: object
    """An OptimizerSet (or torch optimizer) whose params are `opt_params`."""
    opt_params: list[Tensor | None]
    """Per name: the tensor the optimizer steps (its master); None where another rank holds the master."""
    shards: list[Shard | None] | None = None
    """Per name: how this rank's tensor is a piece of the full one (TP/EP), None = the whole tensor."""
    extra: dict[str, Tensor] | None = None
    """Other named state, whole on every rank that holds it (versioned router biases); filled in place."""
    copies: dict[int, list[bool]] | None = None
    """age -> per name: this rank's tensor is a compute-dtype copy of an fp32 master another rank holds (the
    distributed optimizer under bf16). Not saved from here (the owner saves the master under the same key,
    so no key has writers of two dtypes); loaded all the same: DCP copies the saved fp32 values into the
    bf16 tensor, which is the owner's own cast, bit for bit."""
    mirrors: list[bool] | None = None
    """Per name: this rank's tensors of it (every age, buffers, optimizer state) are rows of a tensor another rank
    holds whole and saves (a tied embedding's rows of a vocabulary-parallel head): not saved from here, loaded by
    their global offsets like any piece."""


Shard = Callable[[Tensor], Tensor]
"""Wraps a rank's local piece as a DTensor over its TP/EP submesh, sharing its storage: DCP then saves
and loads global tensors (layout-free keys), and reshards when the layout changes."""


def _global(state: StageState, i: int, t: Tensor) -> Tensor:
    shard = state.shards[i] if state.shards is not None else None
    return t if shard is None else shard(t)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _dcp():
    """torch.distributed.checkpoint, imported at the first save or load rather than with this module: it pulls
    in DTensor and sympy, 46 MB of resident memory and half a second per process, which a process that never
    checkpoints (bench/peers.py's, a run with checkpoint.enabled=false and synthetic data) should not pay.
    (megatron-core's datasets import it anyway, with their whole package.)"""
    import torch.distributed.checkpoint as dcp

    return dcp


def quiet_single_process_dcp() -> None:
    """DCP warns on every save/load without a process group ("assuming the intent is to save in a
    single process"), which is exactly what a single-process run means; keep it out of run logs. A
    process-wide filter for that one message, because async saves write from a background thread
    (a catch_warnings block would be gone by then). Idempotent: warnings keeps one copy of a filter.
    Harmless with a process group: DCP only says this without one."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    inner = getattr(optimizer, "optimizers", None)
    return list(inner.values()) if isinstance(inner, dict) else [optimizer]


def _optimizer_tensors(state: StageState, wrap: bool = True) -> dict[str, Tensor]:
    index_of = {id(p): i for i, p in enumerate(state.opt_params)}
    out = {}
    for opt in _optimizers(state.optimizer):
        for p, st in opt.state.items():
            i = index_of[id(p)]
            for key, value in st.items():
                if not isinstance(value, Tensor):
                    value = torch.tensor(value)
                whole = wrap and value.shape == p.shape
                out[_optim_key(state, i, key, value)] = _global(state, i, value) if whole else value
    return out


def _optim_key(state: StageState, i: int, key: str, value: Tensor) -> str:
    """State shaped like its parameter is sharded like it. Other tensors of a sharded parameter (e.g.
    SOAP's preconditioners of the local block) differ per shard: they are keyed per rank, and only
    a resume with the same TP/EP layout finds them."""
    sharded = state.shards is not None and state.shards[i] is not None
    own = value.dim() > 0 and value.shape != state.opt_params[i].shape and sharded
    suffix = f"/rank{_rank()}" if own else ""
    return f"optim/{state.names[i]}/{key}{suffix}"


def _flat(state: StageState, wrap: bool = True) -> dict[str, Tensor]:
    """Checkpoint key -> tensor; `wrap=False` keeps this rank's local pieces (no DTensor views)."""
    def view(i: int, t: Tensor) -> Tensor:
        return _global(state, i, t) if wrap else t

    flat = {}
    mirror = state.mirrors or [False] * len(state.names)
    for age, tensors in state.versions.items():
        copy = (state.copies or {}).get(age) or [False] * len(tensors)
        flat.update({f"weights/{age}/{n}": view(i, t) for i, (n, t) in enumerate(zip(state.names, tensors))
                     if not copy[i] and not mirror[i]})
    for kind, tensors in state.buffers.items():
        flat.update({f"{kind}/{n}": view(i, t) for i, (n, t) in enumerate(zip(state.names, tensors))
                     if t is not None and not mirror[i]})
    mirrored = {f"optim/{n}/" for n, m in zip(state.names, mirror) if m}
    flat.update({k: t for k, t in _optimizer_tensors(state, wrap).items()
                 if not any(k.startswith(prefix) for prefix in mirrored)})
    flat.update(state.extra or {})
    return flat


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """True if no element of `tensors` is NaN or infinite. One host sync for the lot (not one per tensor);
    integer tensors are finite by definition. Local: no collective."""
    floats = [t for t in tensors if t.is_floating_point() or t.is_complex()]
    if not floats:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in floats]).all())


def nonfinite_tensors(state: StageState) -> list[str]:
    """The checkpoint keys of this rank's tensors that hold a NaN or an infinity (weights of every age,
    Error-Feedback buffers, optimizer state, router biases); [] when the state may be saved. Local: no
    collective; save() agrees on it over all ranks."""
    flat = {k: t for k, t in _flat(state, wrap=False).items() if t.is_floating_point() or t.is_complex()}
    if not flat:
        return []
    finite = torch.stack([torch.isfinite(t).all() for t in flat.values()]).tolist()
    return [k for k, ok in zip(flat, finite) if not ok]


def _refuse_nonfinite(state: StageState, step: int, root: Path) -> None:
    """Collective: raise NonFiniteState on every rank if any rank's state is not finite."""
    bad = nonfinite_tensors(state)
    everyone = [bad]
    if _distributed():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bad)
    found = [(r, k) for r, keys in enumerate(everyone) for k in keys]
    if found:
        shown = ", ".join(f"{k} (rank {r})" for r, k in found[:5])
        good = latest(root)
        raise NonFiniteState(
            f"checkpoint of step {step} refused: {len(found)} tensor(s) hold NaN/Inf, e.g. {shown}; nothing was "
            f"written or pruned, the newest good checkpoint is {good or 'none'}. The run diverged: lower "
            "optimizer.lr (or train.grad_clip), or resume from that checkpoint with other settings")


def code_version() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        sha = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], check=False, cwd=root, capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _rng_state() -> dict:
    """This rank's generators: the CPU's, and the CUDA generator of the current device only (the rank's
    own GPU; the others belong to other ranks, and a run resumed on fewer visible GPUs must still load)."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device()).tolist()
    return state


def _restore_cuda_rng(saved: list) -> None:
    """Set the current device's CUDA generator from a manifest entry. Checkpoints written before this
    format hold one state per visible GPU (a list of lists): the current device's entry is taken."""
    device = torch.cuda.current_device()
    if saved and isinstance(saved[0], list):
        if device >= len(saved):
            warnings.warn(f"the checkpoint holds CUDA RNG states of {len(saved)} GPUs (older format) and this rank "
                          f"runs on cuda:{device}; its CUDA generator is not restored", stacklevel=3)
            return
        saved = saved[device]
    torch.cuda.set_rng_state(torch.tensor(saved, dtype=torch.uint8), device)


def _gather_rng() -> list[dict]:
    mine = _rng_state()
    if not _distributed():
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


class Saver:
    """Writes checkpoints. Collective: every rank calls save() at the same step boundary.

    With `async_save`, DCP stages the tensors to host memory, returns, and writes the shards in a
    background thread on a gloo group of its own (so it never interleaves with training collectives).
    Rank 0 commits the checkpoint (manifest, then rename) from that thread as soon as DCP's future
    resolves: DCP's coordinator (rank 0) resolves only after every rank's shards and the global .metadata
    are on disk, so the commit needs no barrier and no call from the training loop, and a crash after it
    never loses the checkpoint. Until then it is a temporary directory that no resume ever picks up.
    wait() (at the next save and at the end) re-raises a background failure and is a barrier.
    """

    def __init__(self, async_save: bool = False):
        self.async_save = async_save
        self._group = dist.new_group(backend="gloo") if async_save and _distributed() else None
        self._pending: _Pending | None = None
        self.resumed_from: Path | None = None
        """The checkpoint this run resumed from (set by the executor's resume): never pruned by this run, so a
        failed attempt can always start again where it did."""

    def save(self, root: str | os.PathLike, step: int, state: StageState, *, config: dict, layout: dict,
             keep_last: int = 3, data: dict | None = None) -> Path:
        """Raises NonFiniteState (every rank, nothing written) if the state holds NaN/Inf, and
        CheckpointWriteError if a synchronous write fails (its partial directory removed)."""
        self.wait()
        root = Path(root)
        _refuse_nonfinite(state, step, root)
        final = root / f"step_{step:08d}"
        token = [uuid.uuid4().hex[:8]]
        if _distributed():
            dist.broadcast_object_list(token, src=0)
        tmp = root / f"{TMP_PREFIX}{step:08d}-{token[0]}"
        if _rank() == 0:
            tmp.mkdir(parents=True, exist_ok=False)
        _barrier()
        manifest = {"format": FORMAT_VERSION, "step": step, "config": config, "layout": layout,
                    "code_version": code_version(), "rng": _gather_rng(), "saved_at": time.time(), "data": data}
        commit = _Commit(tmp, final, root, keep_last, manifest, self.resumed_from)
        quiet_single_process_dcp()
        if self.async_save:
            future = _dcp().async_save(_flat(state), checkpoint_id=str(tmp), process_group=self._group,
                                    no_dist=not _distributed())
            self._pending = _Pending(future, commit)
            return final
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            _dcp().save(_flat(state), checkpoint_id=str(tmp), no_dist=not _distributed())
        except (Exception, CheckpointException) as e:  # the same on every rank (a BaseException)
            if _os_error(e) is None and _distributed():  # not the disk: a peer died inside DCP's collectives
                commit.abandon()
                raise RuntimeError(f"DCP's collectives failed while saving {final}: {e}") from e
            raise commit.failed(e) from e
        _barrier()  # every rank's shards are on disk (DCP's coordinator wrote .metadata after them)
        error = None
        if _rank() == 0:
            try:
                commit.run()
            except OSError as e:  # the manifest or the rename failed: say so on every rank, not only here
                error = commit.failed(e)
        _agree(error)
        return final

    def wait(self) -> None:
        """Collective. Finish a background save (committed by rank 0 as soon as it was complete); a
        failure on any rank raises CheckpointWriteError on every rank."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.done.wait()
        _agree(pending.error)

    @property
    def committed(self) -> bool:
        """True when no background save is pending, or rank 0 has committed it (other ranks: written)."""
        return self._pending is None or self._pending.done.is_set()


@dataclass
class _Commit:
    tmp: Path
    final: Path
    root: Path
    keep_last: int
    manifest: dict
    protect: Path | None = None

    def run(self) -> None:
        """Rank 0, after every rank's shards and DCP's .metadata are written: manifest, rename, prune."""
        _write_durably(self.tmp / MANIFEST, json.dumps(self.manifest))
        trash = None
        if self.final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
            trash = self.root / f"{TMP_PREFIX}replaced-{self.final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(self.final, trash)
        os.replace(self.tmp, self.final)
        _fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        _prune(self.root, self.keep_last, self.manifest["step"], self.protect)

    def abandon(self) -> None:
        """Remove the partial directory (rank 0; a stale one left by a dead rank 0 goes at the next start)."""
        if _rank() == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def failed(self, error: BaseException) -> CheckpointWriteError:
        """Remove the partial directory (rank 0) and say what happened and what is still there."""
        self.abandon()
        cause = _os_error(error)
        why = str(cause) if cause is not None else f"{type(error).__name__}: {error}"
        return CheckpointWriteError(
            f"writing checkpoint {self.final} failed: {why}; the partial {self.tmp.name} was removed and "
            f"nothing was pruned; the newest complete checkpoint is {latest(self.root) or 'none'}. Free space in "
            f"{self.root} or point checkpoint.dir at a writable disk with room for two checkpoints")


class _Pending:
    """A background save: DCP's future plus rank 0's commit, run from the thread that resolves it."""

    def __init__(self, future, commit: _Commit):
        self.future, self.commit = future, commit
        self.done = threading.Event()
        self.error: BaseException | None = None
        future.add_done_callback(self._finish)  # runs at once if the future is already resolved

    def _finish(self, future) -> None:
        try:
            future.result()
            if _rank() == 0:
                self.commit.run()
        except BaseException as e:  # noqa: BLE001 - kept and re-raised by result() on the training thread
            self.error = self.commit.failed(e)
            self.error.__cause__ = e
        finally:
            self.done.set()



def _agree(error: BaseException | None) -> None:
    """Collective: raise `error` here, and a CheckpointWriteError naming the failed rank on every other
    rank, if any rank failed (no rank is left waiting in a barrier for one that raised)."""
    failed = [None if error is None else str(error)]
    if _distributed():
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, None if error is None else str(error))
    if error is not None:
        raise error
    first = next(((r, e) for r, e in enumerate(failed) if e is not None), None)
    if first is not None:
        raise CheckpointWriteError(f"rank {first[0]}: {first[1]}")


def _os_error(error: BaseException) -> OSError | None:
    """The OSError inside DCP's CheckpointException (which keeps each failed rank's exception)."""
    seen = [error]
    while seen:
        e = seen.pop()
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            seen.extend(v[0] if isinstance(v, tuple) else v for v in failures.values())
        if e.__cause__ is not None:
            seen.append(e.__cause__)
    return None


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` survive a power loss (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str | os.PathLike, step: int, state: StageState, **kwargs) -> Path:
    """Collective, synchronous: writes `root/step_<step>` atomically and prunes old checkpoints."""
    return Saver().save(root, step, state, **kwargs)


def _prune(root: Path, keep_last: int, step: int | None = None, protect: Path | None = None) -> None:
    """Called right after the commit of `step`: only complete checkpoints count, so the newest `keep_last` good
    ones always survive (a refused or failed save commits nothing and prunes nothing). Only the history being
    written is pruned: checkpoints of later steps (another history; preflight refuses to start one in the same
    directory, but a shared checkpoint.dir may still hold one) and the checkpoint the run resumed from are kept."""
    complete = [p for p in list_checkpoints(root) if step is None or (step_of(p) or 0) <= step]
    kept = {Path(protect).resolve()} if protect is not None else set()
    for old in complete[:-keep_last] if keep_last > 0 else []:
        if old.resolve() not in kept:
            shutil.rmtree(old, ignore_errors=True)
    clean_stale(root)  # leftovers of saves that died (none is in flight here)


def clean_stale(root: str | os.PathLike) -> list[Path]:
    """Remove the temporary directories of saves that died (`.tmp-step_*`); returns what was removed.
    Only while no save is in flight: at the start of a run (before any process group) or after a commit."""
    root = Path(root)
    stale = sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def is_complete(path: str | os.PathLike) -> bool:
    """A committed checkpoint: its manifest is written last, after every shard and DCP's .metadata."""
    return (Path(path) / MANIFEST).is_file()


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if is_complete(p))


def latest(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def step_of(path: str | os.PathLike) -> int | None:
    """The step in a step_<N> directory's name, or None."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def damage(path: str | os.PathLike) -> str | None:
    """What is wrong with a checkpoint directory, or None when it is intact: its manifest parses and names its
    step, DCP's .metadata loads, and every shard it indexes is there, as long as the index says. Reads no tensor
    and builds no model, so preflight can check before anything exists."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"it has no {MANIFEST} (an unfinished save)"
    except (OSError, ValueError) as e:
        return f"its {MANIFEST} does not parse ({e}; a torn write)"
    step = manifest.get("step") if isinstance(manifest, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return f"its {MANIFEST} has no integer 'step' (found {step!r})"
    if step_of(path) not in (None, step):
        return f"its {MANIFEST} says step {step}, but the directory is {path.name}"
    if not (path / ".metadata").is_file():
        return "it has no .metadata (DCP's index of the shards)"
    try:
        metadata = _dcp().FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - whatever unpickling a damaged file raises, it is this damage
        return f"its .metadata does not load ({type(e).__name__}: {e})"
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        shard = path / name
        if not shard.is_file():
            return f"its shard {name} is missing"
        if shard.stat().st_size < size:
            return f"its shard {name} holds {shard.stat().st_size} bytes, but .metadata indexes {size} (truncated)"
    return None


def latest_intact(root: str | os.PathLike, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete checkpoint in `root` that is not damaged (see damage()); each newer damaged one is
    named, with what is wrong, through `warn`."""
    for path in reversed(list_checkpoints(root)):
        problem = damage(path)
        if problem is None:
            return path
        if warn is not None:
            warn(f"warning: checkpoint {path} is damaged: {problem}; falling back to an older one (this run will "
                 "write its step again)")
    return None


def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(
            f"{path} is not a complete asyncpp checkpoint (no {MANIFEST}); pick a step_* directory that has one"
        )
    return json.loads((path / MANIFEST).read_text())


def load(path: str | os.PathLike, state: StageState, ages: Sequence[int]) -> dict:
    """Collective. Fill `state` in place from `path`; returns the manifest."""
    manifest = read_manifest(path)
    saved = _dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [a for a in ages if f"weights/{a}/{state.names[0]}" not in saved] if state.names else []
    if missing:
        raise ValueError(
            f"checkpoint {path} holds no weight version of age {missing} (x_(t-{missing[0]})), which this "
            "schedule needs; it was written by a schedule with fewer versions (e.g. sync). Resume with the "
            "schedule it was saved with"
        )
    request = {f"weights/{a}/{n}": _global(state, i, t)
               for a in ages for i, (n, t) in enumerate(zip(state.names, state.versions[a]))}
    for kind, tensors in state.buffers.items():  # absent from older/other runs' checkpoints: keep zeros
        request.update({f"{kind}/{n}": _global(state, i, t)
                        for i, (n, t) in enumerate(zip(state.names, tensors)) if t is not None and f"{kind}/{n}" in saved})
    missing_extra = sorted(k for k in (state.extra or {}) if k not in saved)
    if missing_extra:
        raise ValueError(f"checkpoint {path} lacks {missing_extra[:3]}: it was saved without this state (e.g. "
                         "aux-loss-free router balancing was off); resume with the model config it was saved with")
    request.update(state.extra or {})
    optim, wrapped = _allocate_optimizer_state(state, saved)
    request.update(wrapped)
    quiet_single_process_dcp()
    _dcp().load(request, checkpoint_id=str(path), no_dist=not _distributed())
    _install_optimizer_state(state, optim)
    _restore_rng(manifest)
    return manifest


def _allocate_optimizer_state(state: StageState, saved: dict) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Local buffers for every saved optimizer tensor of this rank's parameters, and what to ask DCP
    for (the same buffers, wrapped as global DTensors where the parameter is sharded)."""
    local, request = {}, {}
    weights = state.versions[min(state.versions)]
    stepped = _stepped(state)
    for i, (name, p) in enumerate(zip(state.names, state.opt_params)):
        if id(p) not in stepped:  # the distributed optimizer: another DP rank owns this parameter's state
            continue
        prefix = f"optim/{name}/"
        full_shape = tuple(_global(state, i, weights[i]).shape)
        for key, meta in saved.items():
            if not key.startswith(prefix) or "/rank" in key[len(prefix):] and not key.endswith(f"/rank{_rank()}"):
                continue
            if tuple(meta.size) == full_shape and full_shape != tuple(p.shape):
                buf = torch.empty(p.shape, dtype=meta.properties.dtype, device=p.device)
                local[key], request[key] = buf, _global(state, i, buf)
            else:
                local[key] = request[key] = torch.empty(meta.size, dtype=meta.properties.dtype, device=p.device)
    return local, request


def _stepped(state: StageState) -> set[int]:
    """Ids of the parameters this rank's optimizer steps (under the distributed optimizer, its share)."""
    return {id(p) for opt in _optimizers(state.optimizer) for g in opt.param_groups for p in g["params"]}


def _install_optimizer_state(state: StageState, tensors: dict[str, Tensor]) -> None:
    by_name = dict(zip(state.names, state.opt_params))
    owner = {id(p): opt for opt in _optimizers(state.optimizer) for g in opt.param_groups for p in g["params"]}
    for key, value in tensors.items():
        _, name, field = key.split("/", 2)
        field = field.split("/rank")[0]
        p = by_name[name]
        opt = owner[id(p)]
        # fused/foreach AdamW keep `step` as a float32 tensor on the params' device: keep its form
        opt.state[p][field] = value.to(p.device)


def _restore_rng(manifest: dict) -> None:
    rng = manifest.get("rng") or []
    rank = _rank()
    same_layout = _distributed() and len(rng) == dist.get_world_size() or not _distributed() and len(rng) == 1
    if same_layout and rank < len(rng):
        torch.set_rng_state(torch.tensor(rng[rank]["torch"], dtype=torch.uint8))
        if "cuda" in rng[rank] and torch.cuda.is_available():
            _restore_cuda_rng(rng[rank]["cuda"])


def checkpoint_root(cfg) -> Path:
    """cfg: a RunConfig. <out_dir>/checkpoints unless checkpoint.dir says otherwise."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.out_dir) / "checkpoints"


def resume_point(cfg, source, warn=print) -> tuple[Path, int] | None:
    """The checkpoint to resume from, per checkpoint.resume ('auto', 'none' or a path), and its step, or
    None; warns (via `warn`) when the data stream changed since it was written. What the simulator's and
    the pipeline's resume share."""
    c = cfg.checkpoint
    if c.resume == "none":
        return None
    path = latest_intact(checkpoint_root(cfg)) if c.resume == "auto" else Path(c.resume)  # preflight said why
    if path is None:  # 'auto' before the first checkpoint
        return None
    manifest = read_manifest(path)  # a clear error if an explicit path is not a complete checkpoint
    check_data_position(manifest, source, cfg, warn=warn)
    return path, manifest["step"]


def due(step_done: int, total_steps: int, every: int) -> bool:
    """Save after `step_done` steps? Every `every` steps and at the end of the run."""
    return step_done == total_steps or (every > 0 and step_done % every == 0)


def data_position(source, step_done: int, batches) -> dict:
    """The data position: consumed samples (batches: the run's asyncpp.core.batches.BatchPlan, cumulative over
    a batch rampup) and what the stream depends on."""
    identity = source.identity() if hasattr(source, "identity") else None
    return {"consumed_samples": batches.samples_before(step_done), "identity": identity}


def check_data_position(manifest: dict, source, cfg, warn=print) -> None:
    """Samples are a pure function of (stream identity, step): say so when a resume changes the stream."""
    saved = (manifest.get("data") or {}).get("identity")
    current = source.identity() if hasattr(source, "identity") else None
    if saved is not None and current is not None and saved != current and _rank() == 0:
        changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        warn(f"warning: the data stream differs from the checkpoint's ({', '.join(changed)}); the resumed run "
             "reads different samples than the uninterrupted one would have")
