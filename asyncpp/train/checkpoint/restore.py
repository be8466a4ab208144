"""Reading a checkpoint back: which one to resume from (the newest intact one, past damaged ones), loading
it into a StageState, and the data position a resume must agree with."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from asyncpp.config import RunConfig
from asyncpp.train.checkpoint.files import MANIFEST, checkpoint_root, list_checkpoints, read_manifest, step_of
from asyncpp.train.checkpoint.rng import restore_rng
from asyncpp.train.checkpoint.runtime import is_distributed, my_rank, quiet_single_process_dcp, torch_dcp
from asyncpp.train.checkpoint.state import (
    StageState,
    allocate_optimizer_state,
    global_view,
    install_optimizer_state,
)


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
        metadata = torch_dcp().FileSystemReader(str(path)).read_metadata()
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


def load(path: str | os.PathLike, state: StageState, ages: Sequence[int]) -> dict:
    """Collective. Fill `state` in place from `path`; returns the manifest."""
    manifest = read_manifest(path)
    saved = torch_dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [a for a in ages if f"weights/{a}/{state.names[0]}" not in saved] if state.names else []
    if missing:
        raise ValueError(
            f"checkpoint {path} holds no weight version of age {missing} (x_(t-{missing[0]})), which this "
            "schedule needs; it was written by a schedule with fewer versions (e.g. sync). Resume with the "
            "schedule it was saved with"
        )
    request = {f"weights/{a}/{n}": global_view(state, i, t)
               for a in ages for i, (n, t) in enumerate(zip(state.names, state.versions[a]))}
    for kind, tensors in state.buffers.items():  # absent from older/other runs' checkpoints: keep zeros
        request.update({f"{kind}/{n}": global_view(state, i, t)
                        for i, (n, t) in enumerate(zip(state.names, tensors)) if t is not None and f"{kind}/{n}" in saved})
    missing_extra = sorted(k for k in (state.extra or {}) if k not in saved)
    if missing_extra:
        raise ValueError(f"checkpoint {path} lacks {missing_extra[:3]}: it was saved without this state (e.g. "
                         "aux-loss-free router balancing was off); resume with the model config it was saved with")
    request.update(state.extra or {})
    optim, wrapped = allocate_optimizer_state(state, saved)
    request.update(wrapped)
    quiet_single_process_dcp()
    torch_dcp().load(request, checkpoint_id=str(path), no_dist=not is_distributed())
    install_optimizer_state(state, optim)
    restore_rng(manifest)
    return manifest


def newest_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The newest weights x_t of a checkpoint (weights/0/<name>) by full-model name, whole tensors in the dtype
    they were saved in, whatever the layout that wrote them (DCP assembles the pieces by their global offsets).
    One process, no process group: for an export or an unsplit model's load_state_dict."""
    return saved_under(path, "weights/0/")


def saved_under(path: str | os.PathLike, prefix: str) -> dict[str, Tensor]:
    """Every tensor a checkpoint saved under `prefix` (e.g. "balancing/0/": the newest router biases), by the rest of
    its key, whole, in one process (as newest_weights)."""
    meta = torch_dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    request = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefix)}
    quiet_single_process_dcp()
    torch_dcp().load(request, checkpoint_id=str(path), no_dist=True)
    return {k[len(prefix):]: v for k, v in request.items()}


def resume_point(cfg: RunConfig, source, warn=print) -> tuple[Path, int] | None:
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


def data_position(source, step_done: int, batches) -> dict:
    """The data position: consumed samples (batches: the run's asyncpp.core.batches.BatchPlan, cumulative over
    a batch rampup), what the stream depends on and, on rank 0 (the manifest's writer, whose stage reads the data),
    the digest of the samples read so far (a run extended to more steps checks it: check_data_position)."""
    identity = source.identity() if hasattr(source, "identity") else None
    consumed = batches.samples_before(step_done)
    out = {"consumed_samples": consumed, "identity": identity}
    if hasattr(source, "order_digest") and my_rank() == 0 and consumed:
        out["order"] = source.order_digest(consumed)
    return out


#: Identity keys a longer run changes on purpose (the sample count its indices are built for): its order is then
#: checked by digest instead.
RUN_LENGTH_KEYS = ("sizes",)


def check_data_position(manifest: dict, source, cfg: RunConfig, warn=print) -> None:
    """Samples are a pure function of (stream identity, step): say so when a resume changes the stream. A run
    extended to more steps (train.steps raised) builds its indices for more samples; its first samples are the
    same as long as the indices span as many epochs, which the manifest's digest of the samples read tells."""
    data = manifest.get("data") or {}
    saved = data.get("identity")
    current = source.identity() if hasattr(source, "identity") else None
    if saved is None or current is None or saved == current or my_rank() != 0:
        return
    changed = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if set(changed) <= set(RUN_LENGTH_KEYS) and data.get("order") is not None and hasattr(source, "order_digest"):
        if source.order_digest(data["consumed_samples"]) == data["order"]:
            return  # a longer run of the same stream: the samples read so far are the ones it would have read
        warn(f"warning: train.steps={cfg.train.steps} builds the data indices for {current['sizes'][0]} samples "
             f"(the checkpoint's run: {saved['sizes'][0]}), which span another number of epochs of the data; megatron-core "
             "shuffles over all of them, so the steps already run read other samples than a run started with "
             f"train.steps={cfg.train.steps} would have. The run continues (its next samples are this stream's); "
             "for one order from the start, start it afresh with the final train.steps")
        return
    warn(f"warning: the data stream differs from the checkpoint's ({', '.join(changed)}); the resumed run "
         "reads different samples than the uninterrupted one would have")
