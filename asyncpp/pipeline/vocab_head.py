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

from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.vocab_parallel import VocabShard, embedding_partial

Wait = Callable[[object, str], None]


@dataclass
class _Pass:
    """What S(t, j) leaves for T(t, j)."""

    hidden: Tensor
    exps: Tensor  # fp32 [N, rows]: exp(logit - the shard's max), shard_statistics_'s
    stats: Tensor  # [3, N]: the shard's own statistics (its max scales exps in T)
    targets: Tensor  # [N], full-vocabulary ids
    gathered: Tensor  # [P x 3, N] once the all-gather has completed
    work: object  # the all-gather; None once waited for


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


def mean_loss(gathered: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(global max, sum of exponentials, the mean cross entropy over the whole vocabulary) from the gathered
    statistics: log(sum) + max - target logit, per token, averaged."""
    top, total, target_logit = combine_statistics(gathered)
    return top, total, (torch.log(total) + top - target_logit).mean()


def logits_gradient(exps: Tensor, stats: Tensor, targets: Tensor, shard: VocabShard, top: Tensor, total: Tensor,
                    *, inplace: bool = False) -> Tensor:
    """d(mean cross entropy)/d(this shard's logits), fp32 [N, rows]: (softmax - onehot) / N, from `exps` and `stats`
    as shard_statistics_ left them (exp(logit - the shard's max) and the shard's [3, N] statistics). `inplace`:
    formed in the exps' own buffer (T's use: they are not needed after it, and a second [N, rows] fp32 buffer would
    be the largest transient of the head, 3 GiB at moe_2b's P=2)."""
    n = exps.shape[0]
    # softmax = exp(logit - shard max) * exp(shard max - global max) / sum: the per-token factor, with the 1/N,
    # is one multiplication over [N, rows]. An empty shard's -inf max gives a factor of 0 over no columns.
    scale = torch.exp(stats[0] - top - torch.log(total) - math.log(n))
    grad = exps if inplace else exps.clone()
    grad.mul_(scale.unsqueeze(-1))
    if shard.rows == 0:
        return grad
    # The target's -1/N as a scatter of a masked column (0 where the target is another shard's row: x + 0 == x):
    # selecting the rows first (nonzero) would size a tensor from the values, a host sync on CUDA.
    inside = (targets >= shard.start) & (targets < shard.end)
    local = (targets - shard.start).clamp(0, shard.rows - 1).unsqueeze(-1)
    return grad.scatter_add_(1, local, inside.to(grad.dtype).mul_(-1.0 / n).unsqueeze(-1))


class _HeldCollectives:
    """Buffers of asynchronous collectives their owner does not wait for (a broadcast's sender, a reduce's
    non-root): kept alive until complete (poll) or until UPDATE(step) (retire: every stage has joined them by
    then), and all waited for at a drain (flush). One lifecycle for the head's and the embedding's."""

    def __init__(self, wait: Wait, what: str):
        self.wait, self.what = wait, what
        self._held: list[tuple[int, Tensor, object]] = []  # (step, buffer, work)

    def add(self, step: int, buffer: Tensor, work) -> None:
        self._held.append((step, buffer, work))

    def poll(self) -> None:
        self._held = [h for h in self._held if not h[2].is_completed()]

    def retire(self, step: int) -> None:
        keep = []
        for s, buffer, work in self._held:
            if s <= step:
                self.wait(work, f"{self.what} of step {s}")
            else:
                keep.append((s, buffer, work))
        self._held = keep

    def flush(self) -> None:
        for s, _, work in self._held:
            self.wait(work, f"{self.what} of step {s}")
        self._held = []


class VocabHead:
    """One stage's part of the vocabulary-parallel head: its rows, the three communicators and the passes."""

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
        self._hidden_in: dict[tuple[int, int], tuple[Tensor, object]] = {}  # posted broadcasts (not the last stage)
        self._input_grads: dict[tuple[int, int], tuple[Tensor, object]] = {}  # the reduces (last stage: awaited at B)
        self._held = _HeldCollectives(wait, "the vocabulary-parallel head's collectives")  # retired at UPDATE(step)
        self._grads: dict[int, Tensor] = {}  # step -> the sum of its T's weight gradients (fp32)
        self.passes = 0  # S passes run, and the logits' widths they had: what the report and the tests read
        self.logits_widths: set[int] = set()
        self.held_peak = 0  # the most S->T passes held at once (1 + the placement's slack in the steady state)

    # ---- the last stage's FORWARD and BACKWARD ------------------------------------------------------------
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
        exps, stats, gathered, work = self._start_statistics(flat, targets)
        self.passes += 1
        self.logits_widths.add(exps.shape[-1])
        self._passes[(step, microbatch)] = _Pass(flat, exps, stats, targets, gathered, work)
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
        top, total, loss = mean_loss(p.gathered)
        with torch.no_grad():
            grad = logits_gradient(p.exps, p.stats, p.targets, self.shard, top, total, inplace=True).to(self.dtype)
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
        if self._passes or self._hidden_in or self._input_grads:
            raise RuntimeError(f"stage {self.mesh.pp_rank}: vocabulary-parallel head passes left at a drain: "
                               f"{sorted(self._passes)} {sorted(self._hidden_in)} {sorted(self._input_grads)}")
        self._held.flush()

    # ---- evaluation (forward only, blocking: one batch at a time) ------------------------------------------
    def evaluate(self, hidden: Tensor | None, targets: Tensor) -> float:
        """The loss of one validation batch over the whole vocabulary, on every stage (blocking)."""
        if hidden is None:
            hidden = torch.empty(self.hidden_shape_of(targets), dtype=self.dtype, device=self.mesh.device)
        hidden = hidden.contiguous()
        self.wait(dist.broadcast(hidden, src=self.last, group=self.groups.hidden, async_op=True),
                  "the vocabulary-parallel head's broadcast of a validation batch")
        _, _, gathered, work = self._start_statistics(hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1))
        self.wait(work, "the vocabulary-parallel head's all-gather of a validation batch's statistics")
        return float(mean_loss(gathered)[2])

    def hidden_shape_of(self, targets: Tensor) -> tuple[int, ...]:
        return (*targets.shape, self.hidden_shape[-1])


class VocabEmbedding:
    """One stage's rows of a sharded input embedding (parallel.embedding=vocab): the same rows as its head shard, so
    a tied model's head and embedding rows are one tensor on each stage. Per microbatch (t, j), on the two
    communicators VocabGroups.embed and embed_grad (one kind of traffic each, issued in microbatch order):

    - E(t, j) on every stage: the lookup of the tokens in the stage's rows on (t, j)'s version, zeros for the
      others (vocab_parallel.embedding_partial), summed onto the first stage by a reduce, asynchronously (each token's
      row lives on one stage: the sum is the unsplit lookup, exactly);
    - the first stage's FORWARD of (t, j) waits for that sum and runs its layers on it; its BACKWARD broadcasts the
      gradient of that input to every stage, asynchronously;
    - G(t, j) on every stage: waits for the broadcast and adds its rows' embedding gradient (the lookup's backward,
      in the weight's dtype as autograd forms it, summed in fp32) into the step's accumulator, which joins b_t's
      gradient before the stage's reductions of step t start (engine: at UPDATE_START(t), or at the step's last G
      when that comes later, as it does on every stage but the first: the first stage's backward is the last one).

    The buffers not waited for by their owner (a non-first stage's partials, the first stage's broadcast gradients)
    are freed when complete (poll) or at UPDATE(t) (retire: every stage has then passed its last G of step t, so
    every reduce and broadcast of step t has been joined)."""

    def __init__(self, mesh: Mesh, shard: VocabShard, param: nn.Parameter, inputs: Callable[[int, int], Tensor],
                 wait: Wait):
        """`param`: the stage's embed.weight, [shard.rows, h] (read on the weight version in use);
        `inputs(step, microbatch)` the microbatch's input token ids [mb, seq]."""
        groups = mesh.vocab_groups
        if groups is None or groups.embed is None or groups.embed_grad is None:
            raise ValueError("parallel.embedding=vocab needs the mesh's embedding groups: build it with "
                             "Mesh(..., vocab_head=True, vocab_embedding=True) on every rank")
        if param.shape[0] != shard.rows:
            raise ValueError(f"the embedding shard has {param.shape[0]} rows, but its VocabShard says {shard.rows}")
        self.mesh, self.shard, self.param, self.inputs, self.wait = mesh, shard, param, inputs, wait
        self.groups = groups
        self.first = mesh.global_rank(0)
        self._sums: dict[tuple[int, int], tuple[Tensor, object]] = {}  # the first stage: reduces awaited at F
        self._grads_out: dict[tuple[int, int], Tensor] = {}  # the first stage: its broadcast gradients, for its G
        self._held = _HeldCollectives(wait, "the sharded embedding's collectives")  # retired at UPDATE(step)
        self._acc: dict[int, Tensor] = {}  # step -> the sum of its G's row gradients (fp32)
        self.lookups = self.gradients = 0  # E and G passes run: what the tests read

    # ---- E and the first stage's FORWARD --------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, step: int, microbatch: int) -> None:
        """E(t, j): this stage's part of the lookup, reduced onto the first stage (not waited for here)."""
        partial = embedding_partial(self.inputs(step, microbatch), self.param, self.shard).contiguous()
        work = dist.reduce(partial, dst=self.first, group=self.groups.embed, async_op=True)
        self.lookups += 1
        if self.mesh.is_first_stage:
            self._sums[(step, microbatch)] = (partial, work)
        else:
            self._held.add(step, partial, work)

    def input(self, step: int, microbatch: int, what: str) -> Tensor:
        """The first stage's FORWARD of (t, j): the summed embedding of its tokens (the layers' input)."""
        buffer, work = self._sums.pop((step, microbatch))
        self.wait(work, f"the sharded embedding's reduce of the lookup of {what}")
        return buffer

    # ---- the first stage's BACKWARD and G ---------------------------------------------------------------------
    def send_grad(self, step: int, microbatch: int, grad: Tensor) -> None:
        """The first stage's BACKWARD of (t, j): broadcast the gradient of its input (not waited for here)."""
        buffer = grad.detach().contiguous()
        work = dist.broadcast(buffer, src=self.first, group=self.groups.embed_grad, async_op=True)
        self._held.add(step, buffer, work)
        self._grads_out[(step, microbatch)] = buffer

    def backward(self, step: int, microbatch: int, what: str) -> None:
        """G(t, j): this stage's rows' embedding gradient of (t, j), into step t's accumulator."""
        ids = self.inputs(step, microbatch)
        if self.mesh.is_first_stage:
            grad = self._grads_out.pop((step, microbatch))
        else:
            grad = torch.empty((*ids.shape, self.param.shape[1]), dtype=self.param.dtype, device=self.mesh.device)
            self.wait(dist.broadcast(grad, src=self.first, group=self.groups.embed_grad, async_op=True),
                      f"the sharded embedding's broadcast of the input gradient of {what}")
        if self.shard.rows == 0:  # a stage without rows (the cost model's or vocab_shards' choice): its lookup is a
            d_weight = torch.zeros_like(self.param)  # constant zero, which autograd cannot differentiate
        else:
            with torch.enable_grad():
                weight = self.param.detach().requires_grad_()
                (d_weight,) = torch.autograd.grad(embedding_partial(ids, weight, self.shard), weight, grad)
        acc = self._acc.get(step)
        self._acc[step] = d_weight.float() if acc is None else acc.add_(d_weight)
        self.gradients += 1

    def add_into(self, step: int, grads: list[Tensor], params: list[nn.Parameter]) -> None:
        """Step t's row gradients join the parameter's entry of b_t's gradient (the engine calls it once every G
        of the step has run)."""
        acc = self._acc.pop(step, None)
        if acc is None:
            return
        i = next(k for k, p in enumerate(params) if p is self.param)
        grads[i].add_(acc.to(grads[i].dtype))

    # ---- retiring ----------------------------------------------------------------------------------------
    def poll(self) -> None:
        self._held.poll()

    def retire(self, step: int) -> None:
        self._held.retire(step)

    def flush(self) -> None:
        if self._sums or self._grads_out or self._acc:
            raise RuntimeError(f"stage {self.mesh.pp_rank}: sharded-embedding passes left at a drain: "
                               f"{sorted(self._sums)} {sorted(self._grads_out)} {sorted(self._acc)}")
        self._held.flush()

    # ---- evaluation (forward only, blocking) ---------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, ids: Tensor) -> Tensor | None:
        """One validation batch's embedding: on the first stage the sum of every stage's part, None elsewhere."""
        partial = embedding_partial(ids, self.param, self.shard).contiguous()
        self.wait(dist.reduce(partial, dst=self.first, group=self.groups.embed, async_op=True),
                  "the sharded embedding's reduce of a validation batch's lookup")
        return partial if self.mesh.is_first_stage else None
