"""A sharded input embedding (parallel.embedding=vocab): each stage holds its head shard's rows of the input
embedding, and the first stage's input is the sum of every stage's part of the lookup (the mechanism and its cost:
asyncpp/core/vocab_split.py; the schedule's E and G actions: asyncpp/schedules/actions.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncpp.core.memory import ESTIMATED, MemoryItem, dtype_name
from asyncpp.parallel.mesh import Mesh
from asyncpp.parallel.vocab_parallel import VocabShard, embedding_partial
from asyncpp.pipeline.parts import HeldCollectives, Part, PartAction, Wait
from asyncpp.schedules.actions import Action, Op


@dataclass(frozen=True)
class EmbeddingHeld:
    """The most of each of a sharded embedding's buffers (VocabEmbedding) a stage holds at once,
    read off its placed schedule (costmodel.place_embedding_passes: the E and G positions the engine runs)."""

    lookups: int
    """[mb, seq, h] in the compute dtype: the first stage's summed embeddings from E until its F; a later stage's
    partials from E until UPDATE(t) retires their reduce (an upper bound: they are freed once complete)."""
    grads: int
    """The first stage's broadcast input gradients [mb, seq, h], from its B until UPDATE(t) retires the broadcast
    (an upper bound, as above); a later stage receives each inside its G (1)."""
    accumulators: int
    """Steps whose rows' gradient [rows, h] (fp32) waits to join the step's gradient (at the later of
    UPDATE_START(t) and the step's last G)."""


def embedding_held(actions: Sequence[Action], first: bool) -> EmbeddingHeld:
    """The peaks of EmbeddingHeld's buffers over one stage's action list, each taken on its own."""
    lookups: set[tuple[int, int]] = set()
    grads: set[tuple[int, int]] = set()
    steps: set[int] = set()
    started: set[int] = set()
    last_g = {a.step: i for i, a in enumerate(actions) if a.op is Op.EMBED_BACKWARD}
    peaks = [0, 0 if first else 1, 0]
    for i, a in enumerate(actions):
        key = (a.step, a.microbatch)
        if a.op is Op.EMBED_FORWARD:
            lookups.add(key)
        elif a.op is Op.FORWARD and first:
            lookups.discard(key)
        elif a.op is Op.BACKWARD and first:
            grads.add(key)
        elif a.op is Op.EMBED_BACKWARD:
            steps.add(a.step)
        elif a.op is Op.UPDATE_START:
            started.add(a.step)
        elif a.op is Op.UPDATE:
            lookups = {k for k in lookups if first or k[0] > a.step}
            grads = {k for k in grads if k[0] > a.step}
        steps = {t for t in steps if not (t in started and last_g.get(t, -1) <= i)}
        peaks = [max(peaks[0], len(lookups)), max(peaks[1], len(grads)), max(peaks[2], len(steps))]
    return EmbeddingHeld(*peaks)


class VocabEmbedding(Part):
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
    every reduce and broadcast of step t has been joined).

    A StagePart on every stage (it owns E and G; its share of b_t is complete at the step's last G), and the first
    stage's entry (parts.StageEntry)."""

    gradient_op = Op.EMBED_BACKWARD
    reads_batches = True  # every stage's rows look the input ids up

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
        self._held = HeldCollectives(wait, "the sharded embedding's collectives")  # retired at UPDATE(step)
        self._acc: dict[int, Tensor] = {}  # step -> the sum of its G's row gradients (fp32)
        self.lookups = self.gradients = 0  # E and G passes run: what the tests read
        self._eval_input: Tensor | None = None  # the first stage's summed embedding of the evaluation batch running

    @classmethod
    def memory_items(cls, actions: Sequence[Action], *, first: bool, tokens: int, rows: int, hidden: int,
                     dtype: torch.dtype) -> list[MemoryItem]:
        """A stage's buffers of a sharded embedding at their peaks over its placed schedule `actions` (the memory
        plan and the dry run ask without an engine; `first`: the first stage), `tokens` = micro_batch_size x seq_len
        and `rows` its shard, and the scratch of its G (the rows' gradient of one microbatch in the weight's dtype,
        before it joins the fp32 sum)."""
        held = embedding_held(actions, first)
        c = dtype.itemsize
        return [
            MemoryItem(f"sharded embedding: lookups [{tokens}, {hidden}] {dtype_name(dtype)} ({held.lookups} held)",
                       held.lookups * c * tokens * hidden, ESTIMATED),
            MemoryItem(f"sharded embedding: input gradients [{tokens}, {hidden}] {dtype_name(dtype)} "
                       f"({held.grads} held)", held.grads * c * tokens * hidden, ESTIMATED),
            MemoryItem(f"sharded embedding: fp32 row gradient accumulators [{rows}, {hidden}] "
                       f"({held.accumulators} steps)", held.accumulators * 4 * rows * hidden, ESTIMATED),
            MemoryItem(f"sharded embedding: G scratch [{rows}, {hidden}]", c * rows * hidden, ESTIMATED),
        ]

    # ---- the StagePart (parts.py): E and G through the engine's table --------------------------------------
    def actions(self) -> dict[Op, PartAction]:
        return {Op.EMBED_FORWARD: PartAction(lambda a, _: self.forward(a.step, a.microbatch)),
                # G reads no weight version of its own: the lookup's backward needs only the ids and the gradient
                Op.EMBED_BACKWARD: PartAction(lambda a, _: self.backward(a.step, a.microbatch, str(a)),
                                              switches_version=False)}

    # ---- the first stage's entry (parts.StageEntry) ---------------------------------------------------------
    def post_input(self, a: Action) -> None:
        pass  # the reduce is posted by the E's

    def input(self, a: Action) -> Tensor:
        """The first stage's FORWARD of (t, j): the sum of every stage's part of the lookup (E)."""
        return self.summed(a.step, a.microbatch, str(a)).requires_grad_()

    def send_input_grad(self, a: Action, x: Tensor) -> Tensor:
        """The first stage's BACKWARD of (t, j): its input's gradient, to every G."""
        sent = x.grad
        self.send_grad(a.step, a.microbatch, sent)
        return sent

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

    def summed(self, step: int, microbatch: int, what: str) -> Tensor:
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
    def evaluate_before(self, inputs: Tensor) -> None:
        """Every stage's part of the batch's lookup, reduced onto the first stage before its layers run."""
        self._eval_input = self.evaluate(inputs)

    def post_evaluation_input(self) -> None:
        pass  # the reduce is posted by every stage's evaluate_before

    def evaluation_input(self, inputs: Tensor) -> Tensor:
        summed, self._eval_input = self._eval_input, None
        return summed

    @torch.no_grad()
    def evaluate(self, ids: Tensor) -> Tensor | None:
        """One validation batch's embedding: on the first stage the sum of every stage's part, None elsewhere."""
        partial = embedding_partial(ids, self.param, self.shard).contiguous()
        self.wait(dist.reduce(partial, dst=self.first, group=self.groups.embed, async_op=True),
                  "the sharded embedding's reduce of a validation batch's lookup")
        return partial if self.mesh.is_first_stage else None
