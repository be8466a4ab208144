"""One pipeline rank's planned memory (asyncpp/core/memory.py) from its real tensors and its schedule: the same
function sizes a dry run (meta tensors, asyncpp/analysis/dryrun.py) and a real run (printed at start, and next
to the measured peak in the summary)."""

from __future__ import annotations

import dataclasses

from asyncpp.config import RunConfig
from asyncpp.core.memory import (
    activation_bytes,
    backward_scratch_bytes,
    embedding_held,
    embedding_items,
    in_flight_microbatches,
    versions_report,
    vocab_head_items,
    vocab_held,
)
from asyncpp.core.partition import stage_split
from asyncpp.core.recompute import modes_per_layer
from asyncpp.core.vocab_split import run_vocab_split, vocab_pipeline, vocab_warmup
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.pipeline.stage import StageSpec
from asyncpp.pipeline.weights import compute_dtype_of
from asyncpp.schedules.actions import Action
from asyncpp.schedules.invariants import peak_in_flight
from asyncpp.schedules.registry import kind_of


def local_shapes_config(model_cfg, dims: ParallelDims):
    """The model config as one TP rank sees it (heads, ffn, vocab divided by tp), for the activation
    estimate: the residual stream stays full width (it is replicated unless sequence parallel)."""
    tp = dims.tp
    if tp == 1:
        return model_cfg
    changes = {"num_heads": model_cfg.num_heads // tp, "num_kv_heads": model_cfg.num_kv_heads // tp,
               "ffn_hidden_size": model_cfg.ffn_hidden_size // tp, "vocab_size": model_cfg.vocab_size // tp}
    if model_cfg.gdn is not None:
        changes["gdn"] = dataclasses.replace(model_cfg.gdn, num_heads=model_cfg.gdn.num_heads // tp)
    if model_cfg.moe is not None:
        m = model_cfg.moe
        changes["moe"] = dataclasses.replace(m, expert_ffn_hidden_size=m.expert_ffn_hidden_size // tp,
                                             shared_expert_ffn_hidden_size=m.shared_expert_ffn_hidden_size // tp)
    return dataclasses.replace(model_cfg, **changes)


def stage_memory(cfg: RunConfig, model_cfg, mesh: Mesh, spec: StageSpec, versions, optimizer, error_feedback):
    """One pipeline rank's memory (asyncpp.core.memory.versions_report) for its stage, shards and schedule:
    the same function sizes a dry run (meta tensors) and a real run (printed at start)."""
    t = cfg.train
    dtype = compute_dtype_of(t.precision)
    recompute = modes_per_layer(t.recompute, model_cfg.num_layers, mesh.num_stages, stage_split(cfg, model_cfg))
    shapes = local_shapes_config(model_cfg, mesh.dims)
    vocab = spec.vocab is not None
    act = activation_bytes(shapes, spec.layers, dtype=dtype,
                           micro_batch_size=t.micro_batch_size, seq_len=t.seq_len,
                           first=spec.is_first, last=spec.is_last, recompute=recompute, head=not vocab)
    tokens = t.micro_batch_size * t.seq_len
    extra = []
    if vocab:  # the placed schedule the engine runs: its extra warm-up forwards and the S/T buffers
        actions = vocab_actions(cfg, model_cfg, spec.stage, mesh.num_stages)
        in_flight = peak_in_flight(actions)
        extra = vocab_head_items(vocab_held(actions, spec.is_last), tokens=tokens, rows=spec.vocab.rows,
                                 hidden=model_cfg.hidden_size, num_stages=mesh.num_stages, dtype=dtype)
        if spec.embed is not None:  # its E and G buffers, read off the same placed schedule
            extra += embedding_items(embedding_held(actions, spec.is_first), tokens=tokens, rows=spec.embed.rows,
                                     hidden=model_cfg.hidden_size, dtype=dtype)
    else:
        in_flight = in_flight_microbatches(cfg.schedule.name, spec.stage, mesh.num_stages, t.num_microbatches,
                                           head_split=spec.head_split)
    # A lazy update (2BW): b_{t+1}'s backward accumulates while b_t's gradient waits for U(t).
    grad_buffers = 2 if kind_of(cfg.schedule.name).lazy_update else 1
    scratch = backward_scratch_bytes(versions.params, grad_itemsize=dtype.itemsize, tokens=tokens,
                                     vocab_size=shapes.vocab_size, last=spec.is_last and not vocab)
    return versions_report(versions, optimizer, error_feedback=error_feedback, activation_bytes_per_mb=act,
                           in_flight=in_flight, grad_buffers=grad_buffers, backward_scratch=scratch, extra=extra,
                           title=f"stage {spec.stage} (rank {mesh.rank}, layers {list(spec.layers)})")


def vocab_actions(cfg: RunConfig, model_cfg, stage: int, num_stages: int, steps: int = 4) -> list[Action]:
    """Stage `stage`'s actions under parallel.head=vocab over `steps` steps at the steady delay: the split, the
    warm-up and the S/T placement StagePlan.of and the executor use (core/vocab_split.py), so the peaks read off
    it are the run's (steps 1 and 2 are the steady state between the warm-up and the drain)."""
    t = cfg.train
    split = run_vocab_split(cfg, model_cfg)
    warmup = vocab_warmup(cfg.schedule.name, t.num_microbatches, split)
    delay = kind_of(cfg.schedule.name).stage_delay(stage, num_stages)
    return vocab_pipeline(cfg.schedule.name, t.num_microbatches, [delay] * steps, split, warmup)[stage]
