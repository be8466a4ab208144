"""Pre-flight checks: what would fail a run late, checked before any process group or model exists.

pretrain.py's main calls `check(cfg, model_cfg, rank=...)` right after the config is validated. Every
failure is a ConfigError (exit code 2, which launch.local does not retry) naming the field, the value and
the fix; nothing here trains, and a passing check changes nothing but the run directories it creates
and the stale `.tmp-step_*` directories of saves that died, which it removes.

Under torchrun, ranks other than 0 do not yet know the run directory (rank 0 broadcasts it later), so
the storage, resume and data checks run on rank 0 only; the device check runs on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from asyncpp.config import ConfigError, RunConfig, parse_blend
from asyncpp.core.batches import BatchPlan
from asyncpp.core.layout import Layout
from asyncpp.core.memory import activation_bytes
from asyncpp.core.vocab_split import validate_vocab_placement
from asyncpp.schedules.invariants import ScheduleError
from asyncpp.train import checkpoint as ckpt
from asyncpp.train.checkpoint.size import checkpoint_size
from asyncpp.train.run_identity import EXIT_CONFIG_ERROR
from data.default import default_cache_dir, default_prefix
from data.indexed import IndexedDataError, check_prefix, check_token_ids
from data.source import resolve_tokenizer
from model_zoo import ModelConfig, build_model
from model_zoo.init import read_weights_file, weight_config_differences

__all__ = [
    "EXIT_CONFIG_ERROR",
    "RunComplete",
    "check",
    "check_data",
    "check_device",
    "check_directories",
    "check_disk_space",
    "check_environment",
    "check_resume",
    "checkpoint_bytes",
    "completed",
    "config_differences",
]

Warn = Callable[[str], None]


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def check(cfg: RunConfig, model_cfg: ModelConfig, *, rank: int = 0, local_world_size: int = 1, warn: Warn = _stderr) -> None:
    """All pre-flight checks of this rank (see the module docstring). Raises ConfigError."""
    check_device(cfg, local_world_size)
    check_vocab_placement(cfg, model_cfg)
    check_memory(cfg, model_cfg, local_world_size)
    if rank != 0:
        return
    point = _check_run(cfg, model_cfg, warn, tidy=True)
    if point is None:  # last: only a run that passed every check moves anything
        keep_an_earlier_run(cfg, warn)


def check_dry_run(cfg: RunConfig, model_cfg: ModelConfig, warn: Warn = _stderr) -> None:
    """dry_run=N: the real run's checks, so that what it would refuse the dry run refuses (the head's placement,
    the sample index, the directories, the resume, the checkpoints' disk space, the data; job.resolve checks the
    multi-process pipeline's options at N > 1 ranks), without those about this machine's devices and memory (the dry run lays out a job for
    another machine, and reports its memory) and without changing anything (no stale save removed, no earlier
    run's record moved)."""
    check_vocab_placement(cfg, model_cfg)
    _check_run(cfg, model_cfg, warn, tidy=False, dry=True)
    done = completed(cfg)
    if done:  # as the real run: a finished run has nothing to lay out (pretrain.py: the line, exit 0)
        raise RunComplete(done)


def _check_run(cfg: RunConfig, model_cfg: ModelConfig, warn: Warn, tidy: bool, dry: bool = False) -> tuple[Path, int] | None:
    """Rank 0's checks of what the run reads and writes; `tidy`: remove the directories of saves that died;
    `dry`: a dry run, which plans a job for another machine, so this disk's room for its checkpoints is a warning
    (a newcomer planning the 8-GPU recipe on a laptop was refused for want of 759 GiB). Returns the resume point."""
    check_sample_index(cfg)
    check_cache(cfg)
    check_directories(cfg)
    removed = ckpt.clean_stale(ckpt.checkpoint_root(cfg)) if tidy else []
    if removed:
        warn(f"preflight: removed {len(removed)} unfinished checkpoint directories ({removed[0].name}, ...)")
    point = check_resume(cfg, warn=warn)
    if cfg.checkpoint.enabled:
        try:
            check_disk_space(cfg, checkpoint_bytes(cfg, model_cfg, point), point)
        except ConfigError as e:
            if not dry:
                raise
            warn(f"warning: {e} (the run itself refuses this; the plan goes on)")
    check_data(cfg, model_cfg)
    check_init_from(cfg, model_cfg)
    return point


def check_init_from(cfg: RunConfig, model_cfg: ModelConfig) -> None:
    """checkpoint.init_from holds weights of the run's model: its recorded model config agrees on every field that
    shapes the weights (config/checkpoint.py checked that the file exists); every tensor's shape is checked again
    where it is copied (model_zoo/init.load_weights_)."""
    path = cfg.checkpoint.init_from
    if path is None:
        return
    try:
        tensors, written = read_weights_file(path)
    except Exception as e:  # a file torch cannot read: say which option points at it
        raise ConfigError(f"checkpoint.init_from={path!r} cannot be read as weights ({type(e).__name__}: {e}); give "
                          "the .pt that `python -m tools.hf import <hf dir> --out <file>.pt` wrote") from e
    differs = weight_config_differences(written, dataclasses.asdict(model_cfg)) if written is not None else []
    if differs:
        raise ConfigError(f"checkpoint.init_from={path!r} holds a model that differs from model={model_cfg.name} in "
                          f"{'; '.join(differs)}; choose the model (or model.overrides) the weights were written for")
    tied = {"lm_head.weight": "embed.weight"} if model_cfg.tie_embeddings else {}
    names = {tied.get(n, n) for n, _ in build_model(model_cfg, device="meta").named_parameters(remove_duplicate=False)}
    missing = sorted(n for n in names if n not in tensors)
    if missing:
        raise ConfigError(f"checkpoint.init_from={path!r} lacks {len(missing)} of model={model_cfg.name}'s tensors "
                          f"({', '.join(missing[:3])}, ...); choose the model the weights were written for")


def check_vocab_placement(cfg: RunConfig, model_cfg: ModelConfig) -> None:
    """An explicit parallel.vocab_placement must give a valid schedule at the run's pp and m (the config validator
    checks its shape; this needs the model's costs)."""
    p = cfg.parallel
    if p.vocab_placement is None:
        return
    vocab = Layout.of(cfg, model_cfg).vocab
    if vocab is None:  # the head is whole (head=vocab at pp=1 is refused)
        return
    try:
        validate_vocab_placement(cfg, vocab)
    except ScheduleError as e:
        raise ConfigError(f"parallel.vocab_placement={list(p.vocab_placement)}: with schedule={cfg.schedule.name}, "
                          f"parallel.pp={p.pp} and train.num_microbatches={cfg.train.num_microbatches} the head's "
                          f"passes cannot be placed so ({e}); lower the warm-up (its first entry), raise "
                          "train.num_microbatches, or leave it null for the cost model's choice") from None


EARLIER_RUN_FILES = ("metrics.jsonl", "summary.json", "timeline.json", "timeline.png")
"""What a run writes into its out_dir that a fresh start there would append to or overwrite (pretrain.log stays:
hydra has it open before the checks run, and a log appended to loses nothing)."""


def keep_an_earlier_run(cfg: RunConfig, warn: Warn = _stderr) -> Path | None:
    """A fresh start (nothing to resume) in an out_dir where an earlier run left its record (it ran without
    checkpoints, or crashed before its first): the record moves to <out_dir>/earlier_<k>/ rather than being
    appended to and overwritten. Returns that directory, or None when there was nothing to keep."""
    out = Path(cfg.out_dir)
    found = [out / name for name in EARLIER_RUN_FILES if (out / name).is_file()]
    if not any(path.name in ("metrics.jsonl", "summary.json") for path in found):
        return None
    k = 1
    while (out / f"earlier_{k}").exists():
        k += 1
    dest = out / f"earlier_{k}"
    dest.mkdir()
    for path in found:
        path.rename(dest / path.name)
    warn(f"preflight: {out} holds an earlier run's record and this run has nothing to resume: moved "
         f"{', '.join(p.name for p in found)} to {dest} (a fresh start would have appended to and overwritten them)")
    return dest


# ---- launcher environment -------------------------------------------------------------------------
RANK_VARIABLES = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}
"""What torchrun sets for each rank, and its value in a run of one process."""
TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent for every rank it starts (and by nothing else)."""


def check_environment(env: Mapping[str, str]) -> None:
    """A process torchrun did not start, with torchrun's rank variables left in its environment (an exported
    WORLD_SIZE of another job, a shell inside a job step): as WORLD_SIZE>1 it would wait in a rendezvous for ranks
    that never come, silently, and as RANK>0 it would write every output into the working directory (hydra's run
    directory is rank 0's). Refused before hydra composes anything. Under torchrun, only malformed values."""
    found = {k: env[k] for k in RANK_VARIABLES if env.get(k, "") != ""}
    bad = {k: v for k, v in found.items() if not v.isdigit()}
    if bad:
        raise ConfigError(f"{', '.join(f'{k}={v!r}' for k, v in bad.items())} in the environment is not a rank "
                          "number; unset it (torchrun sets these for each rank it starts)")
    if env.get(TORCHRUN_MARK) or all(int(v) == int(RANK_VARIABLES[k]) for k, v in found.items()):
        return
    names = [*found, *(k for k in ("MASTER_ADDR", "MASTER_PORT") if env.get(k))]
    listing = ", ".join(f"{k}={env[k]}" for k in names)
    world = int(found.get("WORLD_SIZE", "1"))
    waits = (f"as one process it would wait in the rendezvous at {env.get('MASTER_ADDR', '?')}:"
             f"{env.get('MASTER_PORT', '?')} for {world - 1} rank(s) that nothing starts" if world > 1 else
             f"as rank {found.get('RANK', '0')} it would write its outputs into the working directory")
    raise ConfigError(f"{listing} set in the environment, but torchrun did not start this process (no "
                      f"${TORCHRUN_MARK}): a leftover of another job's environment? {waits}. Unset them (unset "
                      f"{' '.join(names)}) to run one process, or start the ranks with torchrun or "
                      "python -m launch.local --nproc-per-node N")


# ---- device ---------------------------------------------------------------------------------------
def check_device(cfg: RunConfig, local_world_size: int = 1, cuda=torch.cuda) -> None:
    """train.device=cuda needs a CUDA build of torch and one visible GPU per local rank."""
    if torch.device(cfg.train.device).type != "cuda":
        return
    fix = "use train.device=cpu, or run on a machine with GPUs"
    if torch.version.cuda is None:
        raise ConfigError(f"train.device={cfg.train.device} but this torch ({torch.__version__}) was built without "
                          f"CUDA; {fix} (and a CUDA build of torch)")
    if not cuda.is_available():
        raise ConfigError(f"train.device={cfg.train.device} but no CUDA device is visible (no driver, or "
                          f"CUDA_VISIBLE_DEVICES hides them all); {fix}")
    if cuda.device_count() < local_world_size:
        raise ConfigError(f"train.device={cfg.train.device} with {local_world_size} ranks on this node, but only "
                          f"{cuda.device_count()} GPU(s) are visible; start one rank per GPU "
                          "(--nproc-per-node / --gpus-per-node)")


# ---- storage --------------------------------------------------------------------------------------
def _checkpoint_field(cfg: RunConfig) -> str:
    return "checkpoint.dir" if cfg.checkpoint.dir else "checkpoint.dir (default: <out_dir>/checkpoints)"


def _writable_directory(field: str, path: Path) -> None:
    """`path` is (or is made) a directory that takes a file; else a ConfigError naming `field`."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{field}={path} is a file, not a directory; point it at a directory (or remove the file)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".asyncpp-write-probe-")
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{field}={path} is not writable ({e.strerror or e}); point it at a directory this "
                          "user can write, on a disk with room for the run") from None


def check_not_inside_a_checkpoint(cfg: RunConfig) -> None:
    """checkpoint.dir (or out_dir) pointed at one checkpoint (a step_* directory) rather than a run's directory of
    them: the run found no step_* inside it, trained from scratch and wrote its own checkpoints inside another
    run's. Refused, naming what was meant."""
    roots = (("out_dir (hydra.run.dir)", Path(cfg.out_dir)), (_checkpoint_field(cfg), ckpt.checkpoint_root(cfg)))
    for field, path in roots:
        inside = next((p for p in (path, *path.parents) if ckpt.is_complete(p)), None)
        if inside is None:
            continue
        raise ConfigError(
            f"{field}={path} is {'inside ' if inside != path else ''}the checkpoint {inside}, not a directory of "
            f"checkpoints: the run would start from scratch and write into it. To continue from that step, give "
            f"checkpoint.resume={inside} (and a run directory of its own); to continue its run, point "
            f"checkpoint.dir at {inside.parent} (or leave it unset: <out_dir>/checkpoints)")


def check_directories(cfg: RunConfig) -> None:
    """The run directory and (with checkpoint.enabled) the checkpoint directory exist and take a file."""
    check_not_inside_a_checkpoint(cfg)
    dirs = [("out_dir (hydra.run.dir)", Path(cfg.out_dir))]
    if cfg.checkpoint.enabled:
        dirs.append((_checkpoint_field(cfg), ckpt.checkpoint_root(cfg)))
    for field, path in dirs:
        _writable_directory(field, path)


def check_cache(cfg: RunConfig) -> None:
    """The data cache (dataset indices, the default corpus' .bin/.idx) is a writable directory."""
    d = cfg.data
    if d.cache_dir:
        field, path = "data.cache_dir", Path(d.cache_dir)
    else:
        env = os.environ.get("ASYNCPP_CACHE")
        field = "$ASYNCPP_CACHE" if env else "the data cache (data.cache_dir, $ASYNCPP_CACHE: ~/.cache/asyncpp)"
        path = default_cache_dir()
    _writable_directory(field, path)


# ---- resources --------------------------------------------------------------------------------------
INDEX_BYTES_PER_SAMPLE = 24
"""megatron-core's GPTDataset keeps an int64 shuffle index and an (int64 document, int64 offset) sample index
per sample, built in host memory before it is saved to the cache."""


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_sample_index(cfg: RunConfig, host_bytes: int | None = None) -> None:
    """The samples train.steps reads must have an index that fits in this machine's memory."""
    t = cfg.train
    samples = BatchPlan.of(cfg).samples_before(t.steps)
    need = samples * INDEX_BYTES_PER_SAMPLE
    host = host_bytes or host_memory_bytes()
    if need > host:
        raise ConfigError(
            f"train.steps={t.steps} reads {samples:,} samples ({t.global_batch_size} a step); megatron-core's "
            f"sample index for them would take {_gib(need)} ({INDEX_BYTES_PER_SAMPLE} bytes a sample), more than "
            f"this machine's {_gib(host)}; lower train.steps (at most {host // INDEX_BYTES_PER_SAMPLE // max(1, t.global_batch_size):,} "
            "at this batch)")


def planned_bytes(cfg: RunConfig, model_cfg: ModelConfig, distributed: bool) -> int:
    """A lower bound of one rank's memory: every weight version, the gradient and EF buffer and the optimizer's
    state (the checkpoint's estimate), and one microbatch's saved activations; a pipeline rank holds its share
    (1 / pp*tp*ep of the weights, 1 / pp of the activations). Shapes only (a meta model): allocates nothing."""
    state = checkpoint_size(cfg, model_cfg).total
    p, t = cfg.parallel, cfg.train
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    acts = activation_bytes(model_cfg, range(len(model_cfg.layer_types)), dtype=dtype,
                            micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, first=True, last=True)
    if distributed:
        return state // (p.pp * p.tp * p.ep) + acts // p.pp
    return state + acts


def check_memory(cfg: RunConfig, model_cfg: ModelConfig, local_world_size: int = 1, capacity: int | None = None) -> None:
    """Refuse a run whose memory plan cannot fit the device (or, on a CPU, this node's memory shared by its local
    ranks); train.allow_oversubscribe=true runs it anyway (unified memory, a swap the user trusts)."""
    if cfg.train.allow_oversubscribe or cfg.dry_run:
        return
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = torch.device(cfg.train.device)
    if capacity is None:
        if device.type == "cuda" and torch.cuda.is_available():
            capacity = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
            where = f"the GPU's {_gib(capacity)}"
        else:
            capacity = host_memory_bytes() // max(1, local_world_size)
            where = f"this node's {_gib(capacity)} per rank ({local_world_size} local rank(s))"
    else:
        where = f"{_gib(capacity)}"
    need = planned_bytes(cfg, model_cfg, distributed)
    if need > capacity:
        t = cfg.train
        raise ConfigError(
            f"train.micro_batch_size={t.micro_batch_size}, train.seq_len={t.seq_len}, model.name={model_cfg.name}: "
            f"the memory plan needs at least {_gib(need)} a rank, more than {where}; lower "
            "train.micro_batch_size (raise train.num_microbatches to keep the batch), use train.recompute=full or "
            "more pipeline stages, or set train.allow_oversubscribe=true if you know it fits")


def checkpoint_bytes(cfg: RunConfig, model_cfg: ModelConfig, point: tuple[Path, int] | None = None) -> int:
    """The size of one checkpoint of this run: the newest existing one's if any, else its tensors' bytes
    (checkpoint/size.py: every weight version the schedule keeps, the Error-Feedback buffers that are on and the
    optimizer's state, each in its dtype; DCP's index and the manifest add kilobytes)."""
    if point is not None:
        return sum(f.stat().st_size for f in point[0].rglob("*") if f.is_file())
    return checkpoint_size(cfg, model_cfg).total


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def checkpoints_on_disk(cfg: RunConfig, point: tuple[Path, int] | None = None) -> int:
    """How many checkpoints of this run the disk holds at once, at most: checkpoint.keep_last complete ones plus the
    one being written (pruning follows its commit); the one it resumed from is on disk already. No more than the
    run writes (checkpoint.every's saves and the last step's; every_minutes' saves are not known ahead)."""
    c = cfg.checkpoint
    start = point[1] if point is not None else 0
    copies = c.keep_last + 1
    if c.every_minutes == 0:
        every = c.every or cfg.train.steps
        saves = len(set(range(start + every - start % every, cfg.train.steps + 1, every)) | {cfg.train.steps})
        copies = min(copies, saves)
    return copies


def check_disk_space(cfg: RunConfig, per_checkpoint: int, point: tuple[Path, int] | None = None,
                     disk_usage=shutil.disk_usage) -> None:
    """Room for the checkpoints this run keeps at once (checkpoints_on_disk) in the checkpoint directory; the one
    resumed from is on disk already."""
    root = ckpt.checkpoint_root(cfg)
    free = disk_usage(root).free
    copies = checkpoints_on_disk(cfg, point)
    need = copies * per_checkpoint
    if free < need:
        raise ConfigError(
            f"{_checkpoint_field(cfg)}={root} has {_gib(free)} free, but this run needs room for {copies} "
            f"checkpoints of ~{_gib(per_checkpoint)} ({_gib(need)}: checkpoint.keep_last={cfg.checkpoint.keep_last} "
            "kept and the next one written before the oldest is pruned); free space there, lower "
            "checkpoint.keep_last, or set checkpoint.dir to a disk with more room")


# ---- resume ---------------------------------------------------------------------------------------
# What a checkpoint's contents depend on: resuming under another value cannot load it, or would load a
# state that means something else (another optimizer's moments, another schedule's weight versions).
# The seed, the data and the sequence length make the run's identity too: another value reads other samples,
# so a resume under it would continue a history it is not.
INCOMPATIBLE = ("model.", "optimizer.name", "schedule.name", "seed", "data.name", "data.blend", "data.split",
                "data.tokenizer", "train.seq_len")
# Where and how a run goes; never reported. The batch shape is checked against the data position (and
# train.batch_scaling only fills in global_batch_size, which a saved, validated config already holds).
IGNORED = ("out_dir", "dry_run", "dry_run_trace", "dry_run_trace_microbatches", "dry_run_stage", "logging.", "checkpoint.", "parallel.", "data.cache_dir", "train.device",
           "train.timeout_s", "train.compile", "train.backend", "train.allow_oversubscribe", "train.batch_scaling")


def _leaves(tree, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), tree


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or p.endswith(".") and key.startswith(p) for p in patterns)


def config_differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, checkpoint's value, this run's value) for every leaf that differs, IGNORED keys left out."""
    a, b = dict(_leaves(saved)), dict(_leaves(current))
    missing = object()
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, missing), b.get(key, missing)
        if isinstance(x, list) and isinstance(y, tuple | list):
            y = list(y)
        if x is missing and y is None:  # an option added since the checkpoint was saved, left off: no change
            continue
        if x != y and not _matches(key, IGNORED):
            out.append((key, "<absent>" if x is missing else x, "<absent>" if y is missing else y))
    return out


def _fork_fix(cfg: RunConfig, path: Path) -> str:
    name = f"{Path(cfg.out_dir).name}-from-{path.name}"
    return (f"to branch off {path.name}, give the new history a directory of its own: logging.run_name={name} "
            f"checkpoint.resume={path} (or hydra.run.dir=...)")


def _resume_path(cfg: RunConfig, warn: Warn = _stderr) -> Path | None:
    """The checkpoint to resume from, refusing what would lose work: a fresh start, or a resume from anything
    but the newest checkpoint, where checkpoint.dir already holds a history (its newer checkpoints, metrics and
    summary would be overwritten or pruned). A damaged newest checkpoint falls back to the newest intact one."""
    c = cfg.checkpoint
    root = ckpt.checkpoint_root(cfg)
    existing = ckpt.list_checkpoints(root)
    if c.resume == "none":
        if existing and c.enabled:
            raise ConfigError(
                f"checkpoint.resume=none, but {_checkpoint_field(cfg)}={root} holds the checkpoints of an earlier "
                f"run ({', '.join(p.name for p in existing)}); a fresh start there would replace or prune them. "
                "Start afresh in a directory of its own (another logging.run_name, or checkpoint.dir=...), resume "
                "them with checkpoint.resume=auto, or move them away yourself")
        return None
    if c.resume == "auto":
        path = ckpt.latest_intact(root, warn=warn)
        if path is None and existing:
            raise ConfigError(
                f"checkpoint.resume=auto: every checkpoint in {root} is damaged ({existing[-1].name}: "
                f"{ckpt.damage(existing[-1])}); move them away to start afresh, or point checkpoint.resume at an "
                "intact copy")
        return path
    path = Path(c.resume)
    if not ckpt.is_complete(path):
        state = f"is not a complete checkpoint (no {ckpt.MANIFEST})" if path.exists() else "does not exist"
        found = [p.name for p in ckpt.list_checkpoints(path.parent)]
        there = (f"the complete ones in {path.parent} are {found}; use one of them, " if found else
                 f"{path.parent} holds no complete checkpoint; use ")
        raise ConfigError(f"checkpoint.resume={c.resume} {state}; {there}checkpoint.resume=auto (the newest in "
                          "checkpoint.dir) or checkpoint.resume=none")
    problem = ckpt.damage(path)
    if problem is not None:
        good = ckpt.latest_intact(path.parent)
        raise ConfigError(f"checkpoint.resume={c.resume} is damaged: {problem}; resume an intact one"
                          f"{f' (the newest in {path.parent} is {good})' if good else ''}, or repair it")
    step = ckpt.step_of(path)
    if path.parent.resolve() == root.resolve():
        newer = [p.name for p in existing if (ckpt.step_of(p) or 0) > (step or 0)]
        if newer and c.enabled:
            raise ConfigError(
                f"checkpoint.resume={c.resume} is not the newest checkpoint of its run ({', '.join(newer)} came "
                f"after it); continuing it in place would overwrite them, the metrics lines and summary.json of "
                f"{cfg.out_dir}. {_fork_fix(cfg, path)}")
    elif existing and c.enabled:
        raise ConfigError(
            f"checkpoint.resume={c.resume} belongs to another run than {_checkpoint_field(cfg)}={root}, which holds "
            f"checkpoints of its own ({', '.join(p.name for p in existing)}); continuing here would replace or prune "
            f"them. {_fork_fix(cfg, path)}")
    return path


def check_resume(cfg: RunConfig, warn: Warn = _stderr) -> tuple[Path, int] | None:
    """The checkpoint this run would resume from (checkpoint.resume), checked against this config: its step
    below train.steps, the same identity (model, optimizer, schedule, seed, data) and the same data position.
    Returns (path, step) or None; warns about the other differences (hyperparameters a resumed run may change
    on purpose)."""
    path = _resume_path(cfg, warn)
    if path is None:
        return None
    manifest = ckpt.read_manifest(path)
    step = int(manifest["step"])
    differences = config_differences(manifest.get("config") or {}, cfg.to_dict())
    refused = [d for d in differences if _matches(d[0], INCOMPATIBLE)]
    listing = "; ".join(f"{k}: checkpoint {x!r}, this run {y!r}" for k, x, y in differences)
    if refused:
        keys = ", ".join(k for k, _, _ in refused)
        raise ConfigError(
            f"checkpoint.resume={cfg.checkpoint.resume} found {path} (step {step}), which was saved with another "
            f"{keys}; it cannot be resumed by this run. Differences: {listing}. Rerun with the checkpoint's "
            "values, or start a new run (another logging.run_name, or checkpoint.resume=none)")
    if cfg.train.steps < step:
        raise ConfigError(
            f"train.steps={cfg.train.steps}, but the checkpoint to resume from ({path}, checkpoint.resume="
            f"{cfg.checkpoint.resume}) is at step {step}: a run cannot be shortened. Raise train.steps to {step} "
            f"(it is complete) or above {step} to train further, or start afresh under another logging.run_name")
    if cfg.train.steps == step:  # a rerun of a finished command: job.run* says so and pretrain.py exits 0
        return path, step
    check_data_position(cfg, path, manifest)
    if differences:
        warn(f"warning: resuming {path} (step {step}) with a changed config: {listing}")
    return path, step


class RunComplete(Exception):
    """The checkpoint a run resumes from is at train.steps: nothing to train (pretrain.py: one line, exit 0)."""


def completed(cfg: RunConfig) -> str | None:
    """The line that says so when the checkpoint this run would resume from is at train.steps, else None. Plain
    files, no collective: under torchrun rank 0 (which knows the run directory) asks and tells the others."""
    c = cfg.checkpoint
    if c.resume == "none":
        return None
    path = ckpt.latest_intact(ckpt.checkpoint_root(cfg)) if c.resume == "auto" else Path(c.resume)
    if path is None or not ckpt.is_complete(path) or ckpt.read_manifest(path).get("step") != cfg.train.steps:
        return None
    return (f"run complete: {cfg.out_dir} is at step {cfg.train.steps} = train.steps ({path}); nothing to train. "
            f"To continue it, rerun the same command with a larger train.steps")


def check_data_position(cfg: RunConfig, path: Path, manifest: dict) -> None:
    """The checkpoint consumed samples [0, c); this config's step `step` must start reading at exactly c (the
    samples are a function of the microbatch index, so another batch shape would skip or repeat some)."""
    consumed = (manifest.get("data") or {}).get("consumed_samples")
    if consumed is None:  # a checkpoint written before the data position was recorded
        return
    step = int(manifest["step"])
    plan = BatchPlan.of(cfg)
    here = plan.samples_before(step)
    if here == consumed:
        return
    saved = (manifest.get("config") or {}).get("train") or {}
    t = cfg.train
    raise ConfigError(
        f"train.micro_batch_size={t.micro_batch_size}, train.global_batch_size={t.global_batch_size}"
        f"{f', train.batch_rampup={list(t.batch_rampup)}' if t.batch_rampup else ''}: the checkpoint {path} "
        f"consumed {consumed} samples in its {step} steps, but under this batch shape step {step} starts at sample "
        f"{here}, so samples would be {'skipped' if here > consumed else 'read twice'}. Resume with the "
        f"checkpoint's batch shape (train.micro_batch_size={saved.get('micro_batch_size')}, "
        f"train.global_batch_size={saved.get('global_batch_size')}, train.batch_rampup="
        f"{saved.get('batch_rampup')}), or one whose first {step} steps read the same {consumed} samples")


# ---- data -----------------------------------------------------------------------------------------
def check_data(cfg: RunConfig, model_cfg: ModelConfig) -> None:
    """Every prefix of the data is a sound .bin/.idx pair whose sampled token ids fit the model's
    vocabulary, and the tokenizer they were made with fits it too (before any process group exists; the data
    source checks the same when it is built)."""

    d = cfg.data
    try:
        prefixes = _data_prefixes(cfg)
        for prefix in prefixes:
            check_token_ids(check_prefix(prefix), model_cfg.vocab_size)
        tokenizer, _ = resolve_tokenizer(prefixes, d.tokenizer)
    except (IndexedDataError, FileNotFoundError) as e:
        field = "data.blend" if d.name == "indexed" else f"data.name={d.name} (data.cache_dir={d.cache_dir})"
        raise ConfigError(f"{field}: {e}") from None
    check_tokenizer_fits(tokenizer.vocab_size, cfg, model_cfg)


def check_tokenizer_fits(tokenizer_vocab: int, cfg: RunConfig, model_cfg: ModelConfig) -> None:
    """The tokenizer's vocabulary fits the model's embedding (every id it can emit has a row)."""
    if tokenizer_vocab > model_cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer of data.name={cfg.data.name} has {tokenizer_vocab} tokens but model "
            f"'{model_cfg.name}' has vocab_size={model_cfg.vocab_size}; pick a model with a vocabulary at "
            "least as large as the tokenizer's"
        )


def _data_prefixes(cfg: RunConfig) -> list[str]:

    d = cfg.data
    if d.name == "indexed":
        return parse_blend(d.blend)[0]

    # Built here on first use (rank 0, before any other rank reads it): the same files build_data reads.
    return [str(default_prefix(Path(d.cache_dir) if d.cache_dir else default_cache_dir()))]

