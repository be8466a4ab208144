"""Pipeline2BW over a GPTModel whose output layer is spread over the pipeline stages (megatron_vocab.VocabSpreadStage):
the vocabulary-parallel head's S and T passes (pipeline/vocab_head.VocabHead, asyncpp's own) run on every stage,
in the per-call windows of pipeline/vocab_windows.py.

    stage = VocabSpreadStage(gpt, mesh, vocab_split_of(gpt, ...), embedding=False)  # mesh: Mesh.from_megatron(
    optimizer = build_optimizer(stage, ...)                                          #       vocab_head=True)
    fwd_bwd = get_forward_backward_func("2bw", engine_factory=lambda s: VocabPipeline2BW(
        stage, optimizer, mesh, split=split, schedule=s, hidden_size=h, sequence_first=True))

What differs from Pipeline2BW's contract, and why:
- The loss is the head's: the mean cross entropy of every token of the microbatch over the whole vocabulary,
  computed by the stages together (VocabHead's T). The last stage's forward ends at the final norm, so the user's
  loss_func is not called (it would receive hidden states): pretrain_gpt's `loss_mask` is given as a hook,
  `loss_mask(sample)` -> [mb, seq] (like input_ids; without it every token counts, a mask of ones), and the loss is
  then sum(loss * mask) / sum(mask) per microbatch, as pretrain_gpt's loss_func with the front-end's division by
  num_tokens. forward_data_store gets, per microbatch, {"lm loss": [loss sum, tokens]} (pretrain_gpt's report:
  tokens = sum(mask)) from the head, in call k for b_k.
- The labels: every stage's forward_step_func must pass `labels=` to the model (pretrain_gpt's get_batch on every
  stage): the rows of every stage need them. They are taken from the model call's keyword, by (step, microbatch).
- The gradient's 1/m: the head's gradient is that of each microbatch's mean loss, so the engine's reduction scales
  b_t's summed gradient by 1/m (Megatron's division of each loss by m, applied once). A MoE model's router aux
  losses (megatron's MoEAuxLossAutoScaler) are therefore back-propagated at scale 1 per microbatch, not
  Pipeline2BW's 1/m: the same 1/m reaches them through the reduction (the simulator's convention too: sum, then
  divide). Its experts are reduced over the expert-data-parallel group as in Pipeline2BW (param_layouts).
  fp16 loss scaling (config.grad_scale_func): the T passes seed the backward with the scale (VocabHead.loss_scale),
  the aux losses are back-propagated at that scale too, and the reduction scales by 1/(m x scale). A flushed step
  (every call under schedule="1f1b", each synchronous start step under "2bw") is the head's placed stream of that one
  step with delay 0: b_k on x_k, its update applied in call k (the flushed 1F1B baseline on the same spread model).
A tied model keeps its whole table on the first stage: that stage's head rows are the table's own rows, every other
stage's a copy, their gradients summed with the table's over every stage (reduction.RowsOfTied, as asyncpp's own
pipeline does). A sharded input embedding (VocabSpreadStage(embedding=True); give `input_ids`): every stage's E looks
its rows up (VocabEmbedding), the first stage's megatron lookup is replaced by their sum (a forward hook on its
word_embeddings: megatron adds the position embeddings to it as to its own), G takes the rows' gradient.
TP (and SP): every (stage, TP rank) holds its piece of the stage's rows (megatron_vocab.rows_of_rank), the statistics
are gathered over every stage and TP rank, and the last stage's head input enters megatron's TP region as its
output_layer's does (_head_input); untied and with the embedding whole only (megatron_vocab.check_spread_tp).
Evaluation (forward_only) runs each microbatch through the stages and then the head's pass of it on every stage
(VocabHead.evaluate), one microbatch at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from asyncpp.core.vocab_split import VocabSplit, vocab_pipeline, vocab_placement
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.tp import enter_region
from asyncpp.parallel.vocab_parallel import VocabShard
from asyncpp.pipeline.executor import absolute_steps
from asyncpp.pipeline.megatron import Pipeline2BW, _scale_moe_aux_loss, _unwrap, param_layouts
from asyncpp.pipeline.megatron_balancing import megatron_balanced_routers
from asyncpp.pipeline.megatron_vocab import VocabSpreadStage, _gpt
from asyncpp.pipeline.plan import StagePlan, build_stage_runtime
from asyncpp.pipeline.vocab_embedding import VocabEmbedding
from asyncpp.pipeline.vocab_head import VocabHead
from asyncpp.pipeline.vocab_windows import DONE_CALLS, drain_2bw_vocab, window_2bw_vocab
from asyncpp.schedules.actions import Action

_KIND = "2bw"  # the delayed stream's (schedule="1f1b" runs flushed steps only: _sync_window)


def _refusals(model: VocabSpreadStage, mesh: Mesh, kwargs: dict) -> dict[str, object]:
    return {
        "tied (VocabPipeline2BW takes the VocabSpreadStage's own `tied`: pass none)":
            list(kwargs.get("tied", ())) and "a given tied weight",
        "a sharded embedding without input_ids (the tokens of a sample: its E passes read them ahead of the "
        "forward)": model.embedding_sharded and kwargs.get("input_ids") is None,
    }


class VocabPipeline2BW(Pipeline2BW):
    """One stage of a 2BW pipeline whose head is spread over the stages (the module docstring)."""

    DONE_CALLS = DONE_CALLS

    def __init__(self, model: VocabSpreadStage, optimizer, mesh: Mesh, *, split: VocabSplit,
                 input_ids: Callable[[Any], Tensor] | None = None, loss_mask: Callable[[Any], Tensor] | None = None,
                 **kwargs):
        """input_ids(sample): the token ids [mb, seq] of one item of the data_iterator (needed with the embedding
        sharded: every stage's E pass of microbatch j of the call reads the call's j-th sample, ahead of its
        forward_step; the sample is then handed to forward_step_func as usual). loss_mask(sample): its [mb, seq]
        loss mask (pretrain_gpt's get_batch's), read on every stage after the sample's forward (module docstring)."""
        if not isinstance(model, VocabSpreadStage):
            raise TypeError(f"VocabPipeline2BW takes a VocabSpreadStage (megatron_vocab.py), got {type(model).__name__}")
        for name, value in _refusals(model, mesh, {**kwargs, "input_ids": input_ids}).items():
            if value:
                raise NotImplementedError(f"{name}={value!r}: not supported with the output layer spread over the "
                                          "stages yet (asyncpp/pipeline/megatron_vocab_pipeline.py)")
        if mesh.vocab_groups is None:
            raise ValueError("the spread head needs the mesh's vocabulary groups: Mesh.from_megatron(device, "
                             "vocab_head=True) on every rank")
        self.split, self.input_ids, self.loss_mask = split, input_ids, loss_mask
        self._masks: dict[tuple[int, int], Tensor] = {}  # (t, j) -> its loss mask, from its forward to its S
        self._mask_tokens: dict[tuple[int, int], float] = {}  # the last stage's sum(mask) per (t, j), for _report
        self._embedding_input: Tensor | None = None  # the first stage's E sum for the forward running now
        if model.embedding_sharded and mesh.is_first_stage:  # megatron's lookup is replaced by the sum of the E's
            _gpt(model).embedding.word_embeddings.register_forward_hook(self._summed_lookup)
        self._labels: dict[tuple[int, int], Tensor] = {}
        self._tokens: dict[tuple[int, int], Tensor] = {}  # (t, j) -> token ids, from its E to its G
        self._pending_labels: Tensor | None = None
        self._scaled_for: tuple[int, float] | None = None  # the (m, loss scale) the reduction's scale was set for
        model.register_forward_pre_hook(self._take_labels, with_kwargs=True)
        super().__init__(model, optimizer, mesh, **kwargs)
        self.head = self.engine.part(VocabHead)
        self.head.weights = self._mask_of if loss_mask is not None else None

    def _build_engine(self, plan: StagePlan, model: nn.Module, optimizer, tied: Iterable[nn.Parameter]):
        param, row0 = model.head_param()
        shard = VocabShard(model.start, model.shard_rows)

        def head(wait) -> VocabHead:  # its [mb, seq, h] is set per call (_set_activation_shape)
            return VocabHead(self.mesh, shard, param, row0, self._labels_of, (0,), plan.link_dtype, wait)

        def embedding(wait) -> VocabEmbedding:
            return VocabEmbedding(self.mesh, shard, model.embedding_rows, self._tokens_of, wait)

        return build_stage_runtime(plan, None, model, self.mesh, optimizer, self._forward, grad_scale=1.0,
                                   layouts=param_layouts(model), head_part=head, tied=model.tied,
                                   tied_rows=model.tied_rows,
                                   embedding_part=embedding if model.embedding_sharded else None,
                                   routers=megatron_balanced_routers(_gpt(model)))

    # ---- the windows ------------------------------------------------------------------------------------
    def _window(self, m: int, step: int, done: set[Action]) -> list[Action]:
        placement = vocab_placement(_KIND, m, self.split)
        return window_2bw_vocab(_KIND, self.mesh.pp_rank, m, self.split, placement, step, self._stream_start, done)

    def _drain_window(self, done: set[Action]) -> list[Action]:
        placement = vocab_placement(_KIND, self._m, self.split)
        return drain_2bw_vocab(_KIND, self.mesh.pp_rank, self._m, self.split, placement, self.next_step - 1,
                               self._stream_start, done)

    def _train_step(self, m: int) -> None:
        self._call.data_iterator = _Ahead(self._call.data_iterator)  # E reads a sample before its forward_step
        # The head's gradient is the per-microbatch mean's, times the loss scale: b_t's sum / (m * scale). Set only
        # while drained (a stream runs at one m and one scale: Pipeline2BW refuses a change inside one).
        if self.drained and (m, self._loss_scale) != self._scaled_for:
            self.engine.update.rescale(1.0 / (m * self._loss_scale))
            self._scaled_for = (m, self._loss_scale)
        super()._train_step(m)

    def _set_loss_scale(self, scale: float) -> float:
        """config.grad_scale_func's scale (Pipeline2BW._set_loss_scale: one per stream, a change needs a drain): the
        loss is the head's, so its T passes seed the backward with it (VocabHead.loss_scale) and _train_step divides
        it out with 1/m; forward_step's loss (not computed here) gets none."""
        self.head.loss_scale = super()._set_loss_scale(scale)
        return 1.0

    def _sync_window(self, m: int, step: int) -> list[Action]:
        """A flushed step (every 1F1B call, a synchronous start step of 2BW): the schedule's placed head stream of the
        one step with delay 0 (b_step on x_step, its update at the end), the same on every rank."""
        placement = vocab_placement(self.schedule, m, self.split)
        stages = vocab_pipeline(self.schedule, m, [0], self.split, placement)
        return absolute_steps(stages[self.mesh.pp_rank], [0] * (step + 1), step)

    def _set_activation_shape(self, seq_length: int, micro_batch_size: int) -> None:
        super()._set_activation_shape(seq_length, micro_batch_size)
        self.head.hidden_shape = (micro_batch_size, seq_length, self.hidden_size)

    # ---- the microbatch: labels, the last stage's output, the losses ------------------------------------
    def _take_labels(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._pending_labels = kwargs.get("labels")

    def _labels_of(self, step: int, microbatch: int) -> Tensor:
        return self._labels.pop((step, microbatch))

    def _mask_of(self, step: int, microbatch: int) -> Tensor:
        return self._masks.pop((step, microbatch))

    def _take_mask(self, step: int, microbatch: int) -> Tensor | None:
        """The loss mask of the call's `microbatch`-th sample (the loss_mask hook), kept for its S; the last stage
        also keeps its token count for the report."""
        if self.loss_mask is None:
            return None
        mask = self.loss_mask(self._call.data_iterator.sample(microbatch)).detach()
        if mask.shape != self._pending_labels.shape:
            raise ValueError(f"loss_mask(sample) gave shape {tuple(mask.shape)}, but the microbatch's labels are "
                             f"{tuple(self._pending_labels.shape)}: return one weight per label ([mb, seq])")
        if self.mesh.is_last_stage:
            self._mask_tokens[(step, microbatch)] = float(mask.float().sum())
        return mask

    def _tokens_of(self, step: int, microbatch: int) -> Tensor:
        """(t, j)'s token ids, read by its E (the j-th sample of call t: vocab_windows runs b_t's E's in call t) and
        again by its G (which may run in a later call): kept from the first read to the second."""
        kept = self._tokens.pop((step, microbatch), None)
        if kept is not None:
            return kept
        if self._call is None or step != self.next_step:
            raise RuntimeError(f"E of b_{step} outside its call (window rule broken)")
        ids = self.input_ids(self._call.data_iterator.sample(microbatch))
        self._tokens[(step, microbatch)] = ids
        return ids

    def _summed_lookup(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        """The first stage's word-embedding lookup: the E's sum when one is being injected (megatron then adds the
        position embeddings as it would to its own lookup)."""
        return output if self._embedding_input is None else self._embedding_input

    def _forward(self, step: int, microbatch: int, x: Tensor | None) -> Tensor:
        self._pending_labels = None
        out = super()._forward(step, microbatch, x)
        if self._pending_labels is None:
            raise ValueError("forward_step_func called the model without labels=: with the output layer spread over "
                             "the stages every stage's rows need each microbatch's labels (pass them on every stage)")
        self._labels[(step, microbatch)] = self._pending_labels.detach()
        mask = self._take_mask(step, microbatch)
        if mask is not None:
            self._masks[(step, microbatch)] = mask
        return out

    def _forward_step(self, call, x: Tensor | None) -> Tensor:
        """Megatron's forward_step up to the model's output; the last stage's (its normed hidden states [s, b, h])
        goes to the head as [b, s, h]. The loss is the head's (module docstring): loss_func is not called."""
        _unwrap(call.model, "set_input_tensor").set_input_tensor([x])
        if self.model.embedding_sharded and self.mesh.is_first_stage:
            self._embedding_input = x  # [mb, seq, h], the sum of every stage's E (VocabEmbedding.input)
        try:
            output, _ = call.forward_step_func(call.data_iterator, call.model)
        finally:
            self._embedding_input = None
        # a MoE model's aux losses: per microbatch and times the loss scale, as the head's loss (docstring)
        _scale_moe_aux_loss(call.model, 1, self._loss_scale)
        return self._head_input(output) if self.mesh.is_last_stage else output

    def _head_input(self, output: Tensor) -> Tensor:
        """The last stage's normed hidden states [s, b, h] (under SP [s/tp, b, h]) as the head's input [b, s, h],
        entering the TP region as megatron's output_layer (ColumnParallelLinear) and asyncpp's own head (stage.py
        head_input) enter it: under SP the all-gather of the sequence, whose backward reduce-scatters; else a copy
        whose backward all-reduces. So the TP ranks' partial input gradients (each the sum over the stages of its
        rows' part, by the head's reduce) are summed over TP. asyncpp's tp.enter_region, not megatron's mappings:
        megatron's copy_to backward all-reduces grad.contiguous() and returns grad, so the non-contiguous gradient
        of this transposed view would come back unreduced (mappings.py _reduce)."""
        config = _gpt(self.model).config
        return enter_region(output.transpose(0, 1), self.mesh.tp_group, config.sequence_parallel)

    def _report(self, loss: Tensor | float, tokens: float | None = None) -> None:
        """Megatron's report of one microbatch's mean loss: {"lm loss": [loss sum, tokens]} (pretrain_gpt's; tokens:
        sum(loss mask), every token without one)."""
        if tokens is None:
            tokens = float(self.head.hidden_shape[0] * self.head.hidden_shape[1])
        total = torch.as_tensor(loss, dtype=torch.float64).detach() * tokens
        self._call.store.append({"lm loss": torch.stack([total, torch.tensor(tokens, dtype=torch.float64)])})

    def _collect_losses(self) -> None:
        """The last stage's T losses of this call's b_k (vocab_windows runs them in call k)."""
        if self._call is None or not self.mesh.is_last_stage:
            return
        for j, loss in enumerate(self.engine.take_losses(self.next_step)):
            self._report(loss, self._mask_tokens.pop((self.next_step, j), None))

    @torch.no_grad()
    def _forward_only(self, m: int) -> None:
        """Evaluation on the newest weights through a drained pipeline: each microbatch's sharded lookup (if the
        embedding is sharded) and forward on every stage, then the head's pass of it on every stage together (VocabHead.evaluate: blocking, one microbatch at a time;
        every stage's forward of the microbatch has run before, so the last stage's broadcast can be joined)."""
        if not self.drained:
            raise RuntimeError(f"forward_only=True needs a drained pipeline, but b_{self.next_step - 1} is in "
                               "flight: call forward_backward_func.pipeline.drain() first")
        versions, comm = self.engine.versions, self.engine.comm
        versions.use(versions.newest)
        first, last = self.mesh.is_first_stage, self.mesh.is_last_stage
        embedding = self.engine.part(VocabEmbedding)  # sharded: every stage's lookup reduced first (blocking)
        data = self._call.data_iterator = _Ahead(self._call.data_iterator)
        for i in range(m):
            summed = embedding.evaluate(self.input_ids(data.sample(i))) if embedding is not None else None
            if not first:
                comm.post_recv_forward()
            self._pending_labels = None
            out = self._forward_step(self._call, summed if first else comm.recv_forward())
            if self._pending_labels is None:
                raise ValueError("forward_step_func called the model without labels=: every stage's rows need them")
            if not last:
                comm.send_forward(out)
            mask = None if self.loss_mask is None else self.loss_mask(data.sample(i)).detach()
            loss = self.head.evaluate(out if last else None, self._pending_labels, mask)
            if last:
                self._report(loss, None if mask is None else float(mask.float().sum()))
        comm.flush()


class _Ahead:
    """A call's data_iterator that can hand out its j-th item before forward_step_func asks for it (`sample`), and
    then yields the items in order as before."""

    def __init__(self, inner):
        self.inner, self.pulled, self.consumed = inner, [], 0

    def sample(self, j: int):
        while len(self.pulled) <= j:
            self.pulled.append(next(self.inner))
        return self.pulled[j]

    def __iter__(self):
        return self

    def __next__(self):
        item = self.sample(self.consumed)
        self.consumed += 1
        return item
