"""The runtime of parallel.head=vocab: the LM head's vocabulary spread over every pipeline stage (the mechanism,
its cost and the choice of the shards: asyncpp/core/vocab_split.py; the schedule's S and T actions:
asyncpp/schedules/actions.py).

Per microbatch (t, j), on the three communicators of Mesh.vocab_groups (one kind of traffic each, so every member
issues each communicator's ops in the same order, the microbatch order, as NCCL needs: docs/nccl.md):

- the last stage's FORWARD ends with the final norm; its output, the normed hidden states [mb, seq, h], is
  broadcast to every stage (`hidden` communicator), asynchronously: the last stage never waits for it (a
  broadcast's root may complete only once every member joined), its buffer is retired at UPDATE(t) like a send;
- S(t, j) on every stage: the logits of the stage's rows [N, rows] and three per-token statistics, the local max,
  the sum of exponentials below it and the target's logit when the target is one of the rows (0 otherwise); they
  are all-gathered (`stats`), asynchronously. One all-gather instead of the building block's two all-reduces
  (asyncpp/parallel/vocab_parallel.py: the max, then the sums): the global max and the rescaled sum come from
  the gathered pairs (the online softmax), so S never waits inside its own pass. S keeps exp(logit - its max)
  in the logits' buffer;
- T(t, j) waits for the statistics, forms the loss of the whole vocabulary (the same on every stage) and the
  gradient of its logits (softmax - onehot) / N, S's exponentials times one factor per token, then its shard's weight gradient and its partial input gradient,
  which is summed onto the last stage (`grad` communicator: a reduce, asynchronous);
- the last stage's BACKWARD waits for that sum and back-propagates it through the final norm and its layers.

Each pass runs on the weight version of its action (the engine switches first): one version per microbatch across
all shards (semantics.md). The gradients are formed here rather than by autograd because a stage may run T of
b_{t+1} before its UPDATE_START(t) (the placement's steady state): each step's shard gradient waits in its own
accumulator and joins the step's gradient at UPDATE_START(t).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.core.memory import ESTIMATED, MemoryItem, VocabHeld, dtype_name
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.vocab_parallel import VocabShard
from asyncpp.pipeline.parts import HeldCollectives, Part, PartAction, Wait
from asyncpp.schedules.actions import Action, Op


@dataclass
class _Pass:
    """What S(t, j) leaves for T(t, j)."""

    hidden: Tensor
    exps: Tensor  # fp32 [N, rows]: exp(logit - the shard's max), shard_statistics_'s
    stats: Tensor  # [3, N]: the shard's own statistics (its max scales exps in T)
    targets: Tensor  # [N], full-vocabulary ids
    gathered: Tensor  # [P x 3, N] once the all-gather has completed
    work: object  # the all-gather; None once waited for
    weights: Tensor | None = None  # [N] fp32, each token's share of the loss (VocabHead.weights); None: 1/N each


def shard_statistics_(logits: Tensor, targets: Tensor, shard: VocabShard) -> Tensor:
    """[3, N]: this shard's max logit per token, the sum of exp(logit - max) and the target's logit when the target
    is one of its rows (else 0). An empty shard gives (-inf, 0, 0), which the combination ignores.

    In place (the trailing underscore): `logits` [N, rows] is left holding exp(logit - the shard's max), which T
    turns into the gradient with one multiplication (logits_gradient): the exponential is taken once per pass, not
    once in S and again in T, and S needs no [N, rows] temporary."""
    n = logits.shape[0]
    if shard.rows == 0:
        return torch.stack((logits.new_full((n,), float("-inf")), logits.new_zeros(n), logits.new_zeros(n)))
    local_max = logits.amax(dim=-1)
    inside = (targets >= shard.start) & (targets < shard.end)
    local = (targets - shard.start).clamp(0, shard.rows - 1)
    target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    sum_exp = logits.sub_(local_max.unsqueeze(-1)).exp_().sum(dim=-1)
    return torch.stack((local_max, sum_exp, target_logit))


def shard_logits_statistics(flat: Tensor, weight: Tensor, targets: Tensor, shard: VocabShard
                            ) -> tuple[Tensor, Tensor]:
    """S's computation on one shard: the fp32 logits of `flat` [N, h] against the shard's rows `weight` [rows, h],
    exponentiated in place, and their statistics [3, N] (shard_statistics_)."""
    exps = nn.functional.linear(flat, weight).float()
    return exps, shard_statistics_(exps, targets, shard)


def combine_statistics(gathered: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[P x 3, N] -> (global max, sum of exp(logit - global max) over the vocabulary, the target's logit), per token."""
    maxes, sums, targets = gathered.view(-1, 3, gathered.shape[-1]).unbind(1)
    top = maxes.max(dim=0).values
    total = (sums * torch.exp(maxes - top.unsqueeze(0))).sum(dim=0)
    return top, total, targets.sum(dim=0)


def mean_loss(gathered: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(global max, sum of exponentials, the mean cross entropy over the whole vocabulary) from the gathered
    statistics: log(sum) + max - target logit, per token, averaged (`weights` [N]: weighted by them instead,
    token_weights' normalised loss mask)."""
    top, total, target_logit = combine_statistics(gathered)
    per_token = torch.log(total) + top - target_logit
    return top, total, per_token.mean() if weights is None else (per_token * weights).sum()


def token_weights(loss_mask: Tensor) -> Tensor:
    """A microbatch's loss mask [N] as each token's share of its loss: mask / sum(mask) in fp32 (pretrain_gpt's
    sum(loss * mask) / num_tokens; an all-zero mask gives zeros, as the front-end's num_tokens.clamp(min=1))."""
    mask = loss_mask.reshape(-1).float()
    return mask / mask.sum().clamp(min=1)


def logits_gradient(exps: Tensor, stats: Tensor, targets: Tensor, shard: VocabShard, top: Tensor, total: Tensor,
                    *, inplace: bool = False, weights: Tensor | None = None) -> Tensor:
    """d(mean cross entropy)/d(this shard's logits), fp32 [N, rows]: (softmax - onehot) / N, from `exps` and `stats`
    as shard_statistics_ left them (exp(logit - the shard's max) and the shard's [3, N] statistics). `inplace`:
    formed in the exps' own buffer (T's use: they are not needed after it, and a second [N, rows] fp32 buffer would
    be the largest transient of the head, 3 GiB at moe_2b's P=2). `weights` [N]: each token's share of the loss
    (token_weights) in place of 1/N."""
    n = exps.shape[0]
    # softmax = exp(logit - shard max) * exp(shard max - global max) / sum: the per-token factor, with the 1/N,
    # is one multiplication over [N, rows]. An empty shard's -inf max gives a factor of 0 over no columns.
    if weights is None:
        scale = torch.exp(stats[0] - top - torch.log(total) - math.log(n))
    else:
        scale = torch.exp(stats[0] - top - torch.log(total)) * weights
    grad = exps if inplace else exps.clone()
    grad.mul_(scale.unsqueeze(-1))
    if shard.rows == 0:
        return grad
    # The target's -1/N as a scatter of a masked column (0 where the target is another shard's row: x + 0 == x):
    # selecting the rows first (nonzero) would size a tensor from the values, a host sync on CUDA.
    inside = (targets >= shard.start) & (targets < shard.end)
    local = (targets - shard.start).clamp(0, shard.rows - 1).unsqueeze(-1)
    onehot = inside.to(grad.dtype).mul_(-1.0 / n) if weights is None else inside.to(grad.dtype) * -weights
    return grad.scatter_add_(1, local, onehot.unsqueeze(-1))


class VocabHead(Part):
    """One stage's part of the vocabulary-parallel head: its rows, the three communicators and the passes. A
    StagePart on every stage (it owns S and T), and the last stage's exit (parts.StageExit: its FORWARD's output,
    the normed hidden states, goes to every S; its BACKWARD's output gradient is the reduce of every T's)."""

    reads_batches = True  # every stage's rows need the labels

    def __init__(self, mesh: Mesh, shard: VocabShard, param: nn.Parameter, row0: int,
                 labels: Callable[[int, int], Tensor], hidden_shape: tuple[int, ...], dtype: torch.dtype, wait: Wait):
        """The rank's rows of the head, `shard` (its TP rank's piece of its stage's rows), are `param`'s rows
        [row0, row0 + shard.rows) (lm_head.weight from row 0, or the embedding on the first stage of a tied model),
        read on the weight version in use; `labels(step, microbatch)` the microbatch's next-token ids;
        `hidden_shape` [mb, seq, h] in `dtype` (the whole sequence: under sequence parallelism the last stage
        gathers it first)."""
        if mesh.vocab_groups is None:
            raise ValueError("parallel.head=vocab needs the mesh's vocabulary groups: build it with "
                             "Mesh(..., vocab_head=True) on every rank")
        self.mesh, self.shard, self.param, self.row0, self.labels = mesh, shard, param, row0, labels
        self.hidden_shape, self.dtype, self.wait = tuple(hidden_shape), dtype, wait
        self.groups = mesh.vocab_groups
        self.holders = dist.get_world_size(self.groups.stats)  # every stage's TP ranks hold rows of the head
        self.last = mesh.global_rank(mesh.num_stages - 1)
        self._passes: dict[tuple[int, int], _Pass] = {}
        self._own_hidden: dict[tuple[int, int], Tensor] = {}  # the last stage's FORWARD outputs, for its S
        self._hidden_in: dict[tuple[int, int], tuple[Tensor, object]] = {}  # posted broadcasts (not the last stage)
        self._input_grads: dict[tuple[int, int], tuple[Tensor, object]] = {}  # the reduces (last stage: awaited at B)
        self._held = HeldCollectives(wait, "the vocabulary-parallel head's collectives")  # retired at UPDATE(step)
        self._grads: dict[int, Tensor] = {}  # step -> the sum of its T's weight gradients (fp32)
        self.passes = 0  # S passes run, and the logits' widths they had: what the report and the tests read
        self.logits_widths: set[int] = set()
        self.held_peak = 0  # the most S->T passes held at once (1 + the placement's slack in the steady state)
        self._eval_hidden: Tensor | None = None  # the last stage's hidden states of the evaluation batch running
        self.loss_scale = 1.0
        """fp16 loss scaling: T seeds the backward with the loss's gradient times this (the Megatron front-end's
        config.grad_scale_func scale; the step's reduction divides it out before the norm)."""
        self.weights: Callable[[int, int], Tensor] | None = None
        """weights(step, microbatch): the microbatch's loss mask (the Megatron front-end's loss_mask hook), read by
        its S; the loss and its gradient weight each token by mask / sum(mask) (token_weights). None: every token
        1/N (asyncpp's own pipeline)."""

    @classmethod
    def memory_items(cls, held: VocabHeld, *, tokens: int, rows: int, hidden: int, num_stages: int,
                     dtype: torch.dtype) -> list[MemoryItem]:
        """A stage's buffers of the head when it holds `held` of each at once (core/memory.vocab_held, read off the
        placed schedule: the memory plan and the dry run ask without an engine), `tokens` = micro_batch_size x
        seq_len and `rows` its shard, and the scratch of its S and T."""
        c = dtype.itemsize
        per_pass = 4 * tokens * rows + 8 * tokens + 4 * 3 * num_stages * tokens  # logits, labels, gathered stats
        return [
            MemoryItem(f"vocab head: fp32 logits [{tokens}, {rows}] + labels + statistics ({held.passes} held S->T)",
                       held.passes * per_pass, ESTIMATED),
            MemoryItem(f"vocab head: hidden-state broadcast buffers [{tokens}, {hidden}] {dtype_name(dtype)} "
                       f"({held.hidden} held)", held.hidden * c * tokens * hidden, ESTIMATED),
            MemoryItem(f"vocab head: fp32 partial input gradients [{tokens}, {hidden}] ({held.input_grads} held)",
                       held.input_grads * 4 * tokens * hidden, ESTIMATED),
            MemoryItem(f"vocab head: fp32 shard gradient accumulators [{rows}, {hidden}] ({held.accumulators} steps)",
                       held.accumulators * 4 * rows * hidden, ESTIMATED),
            MemoryItem("vocab head: T scratch (the cast logits gradient, the GEMMs' copies, the weight gradient)",
                       vocab_backward_scratch_bytes(tokens=tokens, rows=rows, hidden=hidden, itemsize=c), ESTIMATED),
            MemoryItem("vocab head: S scratch (the GEMM's logits below fp32)",
                       vocab_forward_scratch_bytes(tokens=tokens, rows=rows, itemsize=c), ESTIMATED),
        ]

    # ---- the StagePart (parts.py): S and T through the engine's table --------------------------------------
    def actions(self) -> dict[Op, PartAction]:
        return {Op.VOCAB_FORWARD: PartAction(self._run_s, ready=self._hidden_for),
                Op.VOCAB_BACKWARD: PartAction(self._run_t, ready=self._statistics_for)}

    def _hidden_for(self, a: Action) -> Tensor:
        """Before S(t, j): its hidden states, the last stage's own FORWARD output or the broadcast's (waited for
        outside S's timed compute, as a FORWARD's receive is)."""
        if self.mesh.is_last_stage:
            return self._own_hidden.pop((a.step, a.microbatch))
        return self.received_hidden(a.step, a.microbatch, str(a))

    def _run_s(self, a: Action, hidden: Tensor) -> None:
        self.forward(a.step, a.microbatch, hidden)

    def _statistics_for(self, a: Action) -> None:
        self.await_statistics(a.step, a.microbatch, str(a))

    def _run_t(self, a: Action, _) -> Tensor | None:
        """T(t, j); the microbatch's loss is the last stage's to report (every stage has it)."""
        loss = self.backward(a.step, a.microbatch, str(a))
        return loss if self.mesh.is_last_stage else None

    # ---- the last stage's exit (parts.StageExit): its FORWARD and BACKWARD -----------------------------------
    def post_output_grad(self, a: Action) -> None:
        pass  # the reduce is posted by the T's

    def output(self, a: Action, out: Tensor, is_input: bool) -> None:
        """After the last stage's FORWARD of (t, j): its normed hidden states, to its own S and every other's."""
        self._own_hidden[(a.step, a.microbatch)] = out
        self.send_hidden(a.step, a.microbatch, out)

    def output_grad(self, a: Action) -> Tensor:
        return self.input_grad(a.step, a.microbatch, str(a))

    def evaluation_output(self, out: Tensor) -> None:
        """The last stage's normed hidden states of an evaluation batch, for its evaluate_after."""
        self._eval_hidden = out

    def send_hidden(self, step: int, microbatch: int, hidden: Tensor) -> None:
        """After the last stage's FORWARD of (t, j): broadcast its normed hidden states (not waited for here)."""
        buffer = hidden.detach().contiguous()
        work = dist.broadcast(buffer, src=self.last, group=self.groups.hidden, async_op=True)
        self._held.add(step, buffer, work)

    def input_grad(self, step: int, microbatch: int, what: str) -> Tensor:
        """The last stage's BACKWARD of (t, j): the sum of every stage's partial input gradient."""
        buffer, work = self._input_grads.pop((step, microbatch))
        self.wait(work, f"the vocabulary-parallel head's reduce of the input gradient of {what}")
        return buffer.to(self.dtype)

    # ---- S and T -----------------------------------------------------------------------------------------
    def post_hidden(self, step: int, microbatch: int) -> None:
        """A stage other than the last joins the broadcast of (t, j)'s hidden states (before its S)."""
        if self.mesh.is_last_stage or (step, microbatch) in self._hidden_in:
            return
        buffer = torch.empty(self.hidden_shape, dtype=self.dtype, device=self.mesh.device)
        work = dist.broadcast(buffer, src=self.last, group=self.groups.hidden, async_op=True)
        self._hidden_in[(step, microbatch)] = (buffer, work)

    def weight(self) -> Tensor:
        """[rows, h]: the stage's head rows on the weight version the parameters point at."""
        return self.param.narrow(0, self.row0, self.shard.rows)

    def received_hidden(self, step: int, microbatch: int, what: str) -> Tensor:
        """A stage other than the last, before its S(t, j): the broadcast hidden states of (t, j), waited for (the
        engine waits outside S's timed compute, as it does for a FORWARD's receive)."""
        self.post_hidden(step, microbatch)
        hidden, work = self._hidden_in.pop((step, microbatch))
        self.wait(work, f"the vocabulary-parallel head's broadcast of the hidden states of {what}")
        return hidden

    def forward(self, step: int, microbatch: int, hidden: Tensor) -> None:
        """S(t, j): this shard's logits and statistics of `hidden` (the last stage's own FORWARD output of (t, j),
        or received_hidden's); starts their all-gather."""
        flat = hidden.detach().reshape(-1, hidden.shape[-1])
        targets = self.labels(step, microbatch).reshape(-1)
        weights = None if self.weights is None else token_weights(self.weights(step, microbatch)).to(flat.device)
        exps, stats, gathered, work = self._start_statistics(flat, targets)
        self.passes += 1
        self.logits_widths.add(exps.shape[-1])
        self._passes[(step, microbatch)] = _Pass(flat, exps, stats, targets, gathered, work, weights)
        self.held_peak = max(self.held_peak, len(self._passes))

    @torch.no_grad()
    def _start_statistics(self, flat: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor, object]:
        """This shard's fp32 logits of `flat` [N, h], exponentiated (shard_statistics_), and the start of their
        statistics' all-gather over every holder of head rows: (exps, the shard's statistics [3, N], the gathered
        buffer [holders x 3, N], the work)."""
        exps, stats = shard_logits_statistics(flat, self.weight(), targets, self.shard)
        gathered = stats.new_empty((self.holders * stats.shape[0], stats.shape[1]))  # gloo: stacked on dim 0
        work = dist.all_gather_into_tensor(gathered, stats, group=self.groups.stats, async_op=True)
        return exps, stats, gathered, work

    def await_statistics(self, step: int, microbatch: int, what: str) -> None:
        """Before T(t, j): wait for its statistics' all-gather (the engine waits outside T's timed compute)."""
        p = self._passes[(step, microbatch)]
        if p.work is not None:
            self.wait(p.work, f"the vocabulary-parallel head's all-gather of the softmax statistics of {what}")
            p.work = None

    def backward(self, step: int, microbatch: int, what: str) -> Tensor:
        """T(t, j): returns the microbatch's mean loss (every stage has it), keeps the shard's weight gradient for
        UPDATE_START(t) and starts the reduce of the partial input gradient."""
        self.await_statistics(step, microbatch, what)
        p = self._passes.pop((step, microbatch))
        top, total, loss = mean_loss(p.gathered, p.weights)
        with torch.no_grad():
            grad = logits_gradient(p.exps, p.stats, p.targets, self.shard, top, total, inplace=True, weights=p.weights)
            if self.loss_scale != 1.0:
                grad.mul_(self.loss_scale)
            grad = grad.to(self.dtype)
            weight = self.weight()
            d_weight = grad.t() @ p.hidden  # [rows, h]
            # The partial input gradients in fp32 (exact products of the compute dtype's values), summed in fp32
            # and rounded once on the last stage: the unsplit head's one GEMM rounds once too. In bf16 each
            # partial rounded and the sum taken in bf16 moved every weight by 1e-3 relative per step.
            d_hidden = (grad.float() @ weight.float()).reshape(self.hidden_shape).contiguous()
        acc = self._grads.get(step)
        self._grads[step] = d_weight.float() if acc is None else acc.add_(d_weight)
        work = dist.reduce(d_hidden, dst=self.last, group=self.groups.grad, async_op=True)
        if self.mesh.is_last_stage:
            self._input_grads[(step, microbatch)] = (d_hidden, work)
        else:
            self._held.add(step, d_hidden, work)
        return loss

    def add_into(self, step: int, grads: list[Tensor], params: list[nn.Parameter]) -> None:
        """At UPDATE_START(t): the step's shard gradient joins its rows of the parameter's entry of the step's
        gradient."""
        acc = self._grads.pop(step, None)
        if acc is None:
            return
        i = next(k for k, p in enumerate(params) if p is self.param)
        grads[i].narrow(0, self.row0, self.shard.rows).add_(acc.to(grads[i].dtype))

    # ---- retiring ----------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Free the buffers of completed broadcasts and reduces at once (the engine calls it at every action
        boundary): under 2BW up to 2m of each would otherwise wait for UPDATE(t)."""
        self._held.poll()

    def retire(self, step: int) -> None:
        """At UPDATE(step): every stage has passed UPDATE_START(step) (the norm all-reduce proves it), so every
        broadcast and reduce of steps <= step has been joined by all: waiting for them returns at once."""
        self._held.retire(step)

    def flush(self) -> None:
        """At a drain: everything posted has been used, and what is held completes."""
        if self._passes or self._hidden_in or self._input_grads or self._own_hidden:
            raise RuntimeError(f"stage {self.mesh.pp_rank}: vocabulary-parallel head passes left at a drain: "
                               f"{sorted(self._passes)} {sorted(self._hidden_in)} {sorted(self._input_grads)} "
                               f"{sorted(self._own_hidden)}")
        self._held.flush()

    # ---- evaluation (forward only, blocking: one batch at a time) ------------------------------------------
    def evaluate_after(self, labels: Tensor) -> float | None:
        """Every stage joins the head's pass of the batch (after the last stage's exit took its hidden states); the
        loss is the last stage's to report."""
        hidden, self._eval_hidden = self._eval_hidden, None
        loss = self.evaluate(hidden, labels)
        return loss if self.mesh.is_last_stage else None

    def evaluate(self, hidden: Tensor | None, targets: Tensor, loss_mask: Tensor | None = None) -> float:
        """The loss of one validation batch over the whole vocabulary, on every stage (blocking); with `loss_mask`,
        its masked mean (token_weights)."""
        if hidden is None:
            hidden = torch.empty(self.hidden_shape_of(targets), dtype=self.dtype, device=self.mesh.device)
        hidden = hidden.contiguous()
        self.wait(dist.broadcast(hidden, src=self.last, group=self.groups.hidden, async_op=True),
                  "the vocabulary-parallel head's broadcast of a validation batch")
        _, _, gathered, work = self._start_statistics(hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1))
        self.wait(work, "the vocabulary-parallel head's all-gather of a validation batch's statistics")
        weights = None if loss_mask is None else token_weights(loss_mask).to(hidden.device)
        return float(mean_loss(gathered, weights)[2])

    def hidden_shape_of(self, targets: Tensor) -> tuple[int, ...]:
        return (*targets.shape, self.hidden_shape[-1])


def vocab_forward_scratch_bytes(*, tokens: int, rows: int, itemsize: int) -> int:
    """What S (VocabHead.forward) allocates for a moment above the logits it keeps: below fp32 the GEMM's logits in
    the compute dtype until their fp32 copy exists (c T R); in fp32 the GEMM's output is the kept buffer, and
    shard_statistics_ exponentiates it in place (only [T]-sized statistics beside it)."""
    return itemsize * tokens * rows if itemsize < 4 else 0


def vocab_backward_scratch_bytes(*, tokens: int, rows: int, hidden: int, itemsize: int) -> int:
    """What T (VocabHead.backward) allocates for a moment above the held logits: the logits' gradient is formed in
    place in them (logits_gradient(inplace=True)); then below fp32 its cast to the compute dtype and the fp32 copies
    the partial input gradient's GEMM reads (4 T R + 4 R h), and the shard's weight gradient [R, h] in the compute
    dtype. The partial input gradient itself is a held buffer."""
    if itemsize == 4:
        return 4 * rows * hidden
    return itemsize * (tokens * rows + rows * hidden) + 4 * (tokens * rows + rows * hidden)
