"""One pipeline rank's planned memory (asyncpp/core/memory.py) from its real tensors and its schedule: the same
function sizes a dry run (meta tensors, asyncpp/analysis/dryrun.py) and a real run (printed at start, and next
to the measured peak in the summary)."""

from __future__ import annotations

import dataclasses

from asyncpp.config import RunConfig
from asyncpp.core.layout import Layout
from asyncpp.core.masters import compute_dtype_of
from asyncpp.core.memory import (
    FORWARD_BACKWARD,
    HELD,
    PER_ACTION,
    ActionLoad,
    ActionPeak,
    action_loads,
    activation_bytes,
    backward_scratch_bytes,
    error_feedback_scratch_bytes,
    stage_actions,
    versions_report,
    vocab_held,
)
from asyncpp.core.partition import stage_split
from asyncpp.core.recompute import modes_per_layer
from asyncpp.core.vocab_split import vocab_pipeline
from asyncpp.optim.build import AnyOptimizer
from asyncpp.parallel.mesh import Mesh, ParallelDims
from asyncpp.pipeline.stage import StageSpec
from asyncpp.pipeline.vocab_embedding import VocabEmbedding
from asyncpp.pipeline.vocab_head import VocabHead
from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.invariants import peak_in_flight
from asyncpp.schedules.registry import kind_of
from model_zoo import ModelConfig


def local_shapes_config(model_cfg: ModelConfig, dims: ParallelDims):
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


def stage_memory(cfg: RunConfig, model_cfg: ModelConfig, mesh: Mesh, spec: StageSpec, versions, optimizer: AnyOptimizer, error_feedback):
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
    vocab_items = None
    embedding_bytes = 0
    if vocab:  # the placed schedule the engine runs: its extra warm-up forwards and the S/T buffers
        actions = vocab_actions(cfg, model_cfg, spec.stage, mesh.num_stages)

        def vocab_items(held):
            return VocabHead.memory_items(held, tokens=tokens, rows=spec.vocab.rows, hidden=model_cfg.hidden_size,
                                          num_stages=mesh.num_stages, dtype=dtype)

        extra = [dataclasses.replace(i, phase=FORWARD_BACKWARD)
                 for i in vocab_items(vocab_held(actions, spec.is_last))]
        if spec.embed is not None:  # its E and G buffers, read off the same placed schedule
            embedding = VocabEmbedding.memory_items(actions, first=spec.is_first, tokens=tokens, rows=spec.embed.rows,
                                                    hidden=model_cfg.hidden_size, dtype=dtype)
            extra += [dataclasses.replace(i, phase=FORWARD_BACKWARD) for i in embedding]
            embedding_bytes = sum(i.nbytes for i in embedding)  # not walked per action: every action, at its peaks
    else:
        actions = stage_actions(cfg.schedule.name, spec.stage, mesh.num_stages, t.num_microbatches)
    # A lazy update (2BW): b_{t+1}'s backward accumulates while b_t's gradient waits for U(t).
    grad_buffers = 2 if kind_of(cfg.schedule.name).lazy_update else 1
    scratch = backward_scratch_bytes(versions.params, grad_itemsize=dtype.itemsize, tokens=tokens,
                                     vocab_size=shapes.vocab_size, last=spec.is_last and not vocab)
    report = versions_report(versions, optimizer, error_feedback=error_feedback, activation_bytes_per_mb=act,
                             in_flight=peak_in_flight(actions), grad_buffers=grad_buffers, backward_scratch=scratch,
                             extra=extra, ef_lambda=cfg.staleness.ef_lambda,
                             title=f"stage {spec.stage} (rank {mesh.rank}, layers {list(spec.layers)})")
    owned = [q for q in versions.masters if q is not None] if versions.mixed else versions.params
    update_scratch = (report.get("update scratch (fp32") if versions.mixed else 0) + \
        error_feedback_scratch_bytes(owned, cfg.staleness.ef_lambda)
    scratch_of = {Op.BACKWARD: scratch, Op.UPDATE: update_scratch}
    # The gradient sets are counted per action too: a set exists from its step's first BACKWARD (the fp32 sums of
    # GradSums under mixed precision) to its UPDATE, so a warm-up's forwards run without one.
    per_set = report.get("gradients") // grad_buffers
    loads = action_loads(actions, spec.is_last, recycled_grads=not versions.mixed and versions.num_buffers > 1)
    report.peaks = action_peaks(loads, act, per_set, scratch_of, vocab_items, embedding_bytes)
    # The total counts these items action by action now (the peaks): the table shows each at its own peak.
    counted = [i.phase != HELD or i.name.startswith("gradients") for i in report.items]
    report.items = [dataclasses.replace(i, phase=PER_ACTION) if c else i for i, c in zip(report.items, counted)]
    return report


def action_peaks(loads: list[ActionLoad], per_microbatch: int, per_grad_set: int, scratch_of: dict[Op, int],
                 vocab_items=None, embedding_bytes: int = 0) -> list[ActionPeak]:
    """The largest share above the held items of each kind of action in the stage's list (core/memory.action_loads):
    its gradient sets and microbatches' activations, the vocabulary head's buffers while it runs
    (`vocab_items(held)`: VocabHead.memory_items, whose S and T scratch count only in S and T), and its own
    scratch (`scratch_of`: the loss backward's, the update's). A sharded embedding's buffers (parallel.embedding=vocab,
    `embedding_bytes`) are not walked action by action yet: each action counts all of them at their peaks."""
    best: dict[Op, ActionPeak] = {}
    for load in loads:
        op = load.action.op
        parts = [(f"{load.grad_sets} gradient sets", load.grad_sets * per_grad_set),
                 (f"{load.in_flight} microbatches' activations", load.in_flight * per_microbatch)]
        if vocab_items is not None:
            items = vocab_items(load.vocab)
            scratch = {Op.VOCAB_FORWARD: "vocab head: S scratch", Op.VOCAB_BACKWARD: "vocab head: T scratch"}
            parts.append(("vocab head buffers", sum(i.nbytes for i in items if "scratch" not in i.name)))
            if op in scratch:
                parts.append((f"{op.value} scratch", sum(i.nbytes for i in items if i.name.startswith(scratch[op]))))
        if scratch_of.get(op):
            parts.append(("scratch", scratch_of[op]))
        parts.append(("sharded embedding buffers", embedding_bytes))
        total = sum(b for _, b in parts)
        if op not in best or total > best[op].nbytes:
            what = " + ".join(n for n, b in parts if b)
            best[op] = ActionPeak(op.name, str(load.action), total, what or "nothing")
    return list(best.values())


STEADY_STEPS = 4
"""The steps of a list that holds a steady-state step between the warm-up and the drain (steps 1 and 2): with the
vocabulary-parallel head, UPDATE(t) for t >= 1 sits after step t+1's last forward, where two microbatches are in
flight next to two gradient sets and the update's scratch, and UPDATE(1) is there only if step 2 is not the last (at
3 steps it falls into the drain). The plan's UPDATE share is read off such a list, and a trace runs one
(analysis/traced.TRACED_STEPS)."""


def vocab_actions(cfg: RunConfig, model_cfg: ModelConfig, stage: int, num_stages: int, steps: int = STEADY_STEPS) -> list[Action]:
    """Stage `stage`'s actions under parallel.head=vocab over `steps` steps at the steady delay: the split, the
    warm-up, the slack and the S/T placement StagePlan.of and the executor use (core/vocab_split.py), so the peaks read off
    it are the run's (STEADY_STEPS: why the default)."""
    t = cfg.train
    layout = Layout.of(cfg, model_cfg)
    delay = kind_of(cfg.schedule.name).stage_delay(stage, num_stages)
    return vocab_pipeline(cfg.schedule.name, t.num_microbatches, [delay] * steps, layout.vocab, layout.placement)[stage]
