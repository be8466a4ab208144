"""Explicit process groups: built once from ParallelDims, passed to whoever needs a group.

Rank layout follows Megatron's default order (tp fastest, then dp, then pp):

    global_rank = (pp_rank * dp + dp_rank) * tp + tp_rank,    dp_rank = edp_rank * ep + ep_rank

so a pipeline's neighbours are `dp * tp` ranks apart and a TP group is contiguous (one node).
Expert parallelism is carved out of data parallelism, as in Megatron: the `ep` consecutive DP ranks
of an EP group see different tokens and hold different experts; the `dp / ep` ranks that hold the
same experts form the expert-data-parallel ("edp") group that reduces the expert gradients.
The mesh is a torch DeviceMesh with dims ("pp", "edp", "ep", "tp"); it works with gloo on CPU and
NCCL on GPU alike. There are no module-level groups anywhere in asyncpp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from asyncpp.config import ConfigError, divisors
from asyncpp.parallel.collectives import bound_group


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def for_world(cls, world_size: int, *, pp: int, tp: int = 1, ep: int = 1, dp: int | None = None) -> ParallelDims:
        """Derive dp = world_size / (pp * tp) (Megatron's rule) and check an explicit dp against it."""
        for name, value in (("pp", pp), ("tp", tp), ("ep", ep), ("dp", dp)):
            if value is not None and value < 1:  # before dividing by them
                raise ConfigError(f"parallel.{name}={value} must be >= 1"
                                  f"{' (or null to derive it from the world size)' if name == 'dp' else ''}")
        if world_size % (pp * tp):
            raise ConfigError(
                f"the job has {world_size} ranks, which is not divisible by parallel.tp={tp} x parallel.pp={pp} "
                f"= {tp * pp}; launch a multiple of {tp * pp} processes or change the layout"
            )
        derived = world_size // (pp * tp)
        if dp is not None and dp != derived:
            raise ConfigError(
                f"parallel.dp={dp} but {world_size} ranks / (parallel.tp={tp} x parallel.pp={pp}) gives {derived}; "
                "set parallel.dp=null to derive it"
            )
        return cls(pp=pp, dp=derived, tp=tp, ep=ep).validate(world_size)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def validate(self, world_size: int) -> ParallelDims:
        for name in ("pp", "dp", "tp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.world_size != world_size:
            raise ConfigError(
                f"parallel.pp={self.pp} x parallel.dp={self.dp} x parallel.tp={self.tp} = {self.world_size} "
                f"ranks, but the job has {world_size}; make their product equal the number of processes "
                "(torchrun --nproc_per_node x nodes)"
            )
        if self.dp % self.ep:
            raise ConfigError(
                f"parallel.ep={self.ep} does not divide the {self.dp} data-parallel ranks (expert parallelism is "
                f"carved out of data parallelism); choose parallel.ep in {divisors(self.dp)}"
                " or launch more ranks"
            )
        return self

    @property
    def edp(self) -> int:
        """Replicas of each expert: data-parallel ranks / expert-parallel ranks."""
        return self.dp // self.ep


@dataclass(frozen=True)
class PipelineLinks:
    """This rank's p2p groups (None at the pipeline's ends): one 2-rank group per link and direction."""

    recv_forward: dist.ProcessGroup | None  # activations from stage s-1
    send_forward: dist.ProcessGroup | None  # activations to stage s+1
    recv_backward: dist.ProcessGroup | None  # output gradients from stage s+1
    send_backward: dist.ProcessGroup | None  # input gradients to stage s-1


@dataclass(frozen=True)
class VocabGroups:
    """parallel.head=vocab: three groups, one kind of traffic each (pipeline/vocab_head.py): the last stage's
    broadcast of the normed hidden states and the reduce of the partial input gradients onto the last stage, over
    the stages of each pipeline (one per TP rank); the all-gather of the softmax statistics over every stage and
    TP rank of the replica (each holds other rows of the head)."""

    hidden: dist.ProcessGroup
    stats: dist.ProcessGroup
    grad: dist.ProcessGroup
    embed: dist.ProcessGroup | None = None
    """parallel.embedding=vocab: the reduce of the partial embeddings onto the first stage, per pipeline."""
    embed_grad: dist.ProcessGroup | None = None
    """... and the broadcast of the first stage's embedding gradient back to every stage."""


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Mesh:
    """This rank's view of the job: coordinates and groups along pp / dp / tp."""

    def __init__(self, dims: ParallelDims, device: torch.device, *, vocab_head: bool = False,
                 vocab_embedding: bool = False, timeout_s: float | None = None):
        """vocab_head: the vocabulary-parallel
        head's three groups (VocabGroups), and the tied-embedding group then spans every stage (each holds rows of
        the tied weight); vocab_embedding (with vocab_head): a sharded embedding's two more groups (VocabGroups.embed,
        embed_grad); every rank must pass the same.
        timeout_s: every group's timeout (train.timeout_s); None: the default group's, which init_distributed
        set to train.timeout_s (a process group made by other means keeps torch's default)."""
        self.dims = dims
        self.device = device
        self.device_mesh: DeviceMesh = init_device_mesh(
            device.type, (dims.pp, dims.edp, dims.ep, dims.tp), mesh_dim_names=("pp", "edp", "ep", "tp")
        )
        m = self.device_mesh
        self.rank = dist.get_rank()
        # _flatten: DeviceMesh's (private, but what torchtitan builds on) way to view several dims as
        # one group; collective, so every rank makes the same calls in the same order.
        dp_mesh = m["edp", "ep"]._flatten("dp") if dims.ep > 1 else m["edp"]
        self.pp_rank = m.get_local_rank("pp")
        self.dp_rank = dp_mesh.get_local_rank()
        self.tp_rank = m.get_local_rank("tp")
        self.ep_rank = m.get_local_rank("ep")
        self.edp_rank = m.get_local_rank("edp")
        self.pp_group = m.get_group("pp")
        self.dp_group = dp_mesh.get_group()
        self.tp_group = m.get_group("tp")
        self.ep_group = m.get_group("ep")
        self.edp_group = m.get_group("edp")
        # The global gradient norm sums over everything that is not a replica of something else:
        # stages, TP shards and EP shards (replicated tensors are counted on tp/ep rank 0 only).
        # Every cross-stage group below carries one kind of traffic only, so on NCCL each communicator
        # sees its ops in the same order on every member (docs/nccl.md): the norm all-reduce never
        # shares one with the pipeline's p2p or with the tied-embedding all-reduce, also at P=2.
        self.norm_group = self._norm_groups()
        # {first stage, last stage} of each pipeline, for the tied embedding's gradient.
        self.embedding_group = (self._per_pipeline(list(range(dims.pp)) if vocab_head else [0, dims.pp - 1])
                                if dims.pp > 1 else None)
        self.links = self._build_links()
        self.vocab_groups = self._vocab_groups(vocab_embedding) if vocab_head and dims.pp > 1 else None
        # The distributed optimizer's norm (pipeline/reduction.ShardedGradientReduction): each rank holds
        # a distinct piece of the reduced gradient, so the squared norm is summed over the whole job, on
        # a communicator of its own. Created for every DP run (new_group is collective: every rank makes
        # it at the same point); an NCCL communicator exists only once used.
        self.replica_norm_group = dist.new_group(list(range(dims.world_size))) if dims.dp > 1 else self.norm_group
        self._bound_groups(timeout_s if timeout_s is not None else _job_timeout_s(device))

    def _vocab_groups(self, vocab_embedding: bool) -> VocabGroups:
        """A vocabulary-parallel head's groups (and a sharded embedding's two more): new ones, each carrying one
        kind of traffic. Collective: every rank creates every group in the same order."""
        everyone = list(range(self.dims.pp))
        return VocabGroups(hidden=self._per_pipeline(everyone), stats=self._per_data_replica(),
                           grad=self._per_pipeline(everyone),
                           # Created after the three, so a run without them makes the same groups.
                           **({"embed": self._per_pipeline(everyone),
                               "embed_grad": self._per_pipeline(everyone)} if vocab_embedding else {}))

    @classmethod
    def from_megatron(cls, device: torch.device, *, vocab_head: bool = False, vocab_embedding: bool = False,
                      timeout_s: float | None = None) -> Mesh:
        """This rank's mesh over megatron-core's initialized `parallel_state`: its pipeline, tensor, data,
        expert, expert-data and embedding groups are used as they are, so a Megatron-LM job builds no second set.

        asyncpp adds only what megatron-core has no group for: the per-direction pipeline links, 2 (P-1)
        2-rank groups per pipeline (`_build_links`; a rank is in at most 4), which carry asyncpp's p2p
        (megatron's own p2p shares the pipeline group for both directions). The gradient norm's group is
        megatron's model-parallel group (pp x tp ranks of one replica; with ep > 1 its expert-tensor-model-
        pipeline group, pp x ep x tp): megatron reduces its own grad norm there, which asyncpp's update replaces.
        The layout must be megatron's default order ("tp-cp-ep-dp-pp"), which is asyncpp's (module docstring);
        every group's ranks are checked against it. No context parallelism, no virtual pipeline stages, expert
        tensor parallelism equal to tensor parallelism, no head split.

        vocab_head / vocab_embedding: as in the constructor, a vocabulary-parallel head's (and a sharded embedding's)
        groups, which megatron-core has no counterpart of, made over megatron's pipelines; the tied-embedding group
        then spans every stage of the pipeline (each holds rows of the tied weight) and is asyncpp's, not megatron's
        first-and-last-stage one (which megatron's own constructor still uses for its initial copy)."""
        # megatron-core is optional and a heavy import: only this path needs it.
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("Mesh.from_megatron() needs megatron-core's parallel_state: call "
                               "parallel_state.initialize_model_parallel(...) first")
        unsupported = {"context_parallel_size": ps.get_context_parallel_world_size(),
                       "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size() or 1}
        for name, value in unsupported.items():
            if value != 1:
                raise NotImplementedError(f"{name}={value}: asyncpp's pipeline supports 1 only")
        tp, etp = ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        if etp != tp:
            raise NotImplementedError(f"expert_tensor_parallel_size={etp} differs from tensor_model_parallel_size={tp}; "
                                      "asyncpp's layout has one tensor-parallel degree")
        dims = ParallelDims(pp=ps.get_pipeline_model_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
                            tp=tp, ep=ps.get_expert_model_parallel_world_size()).validate(dist.get_world_size())
        self = cls.__new__(cls)
        self.dims, self.device, self.rank = dims, device, dist.get_rank()
        self.pp_rank, self.dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
        self.tp_rank, self.ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.pp_group, self.tp_group = ps.get_pipeline_model_parallel_group(), ps.get_tensor_model_parallel_group()
        self.dp_group, self.ep_group = ps.get_data_parallel_group(), ps.get_expert_model_parallel_group()
        self.edp_group = ps.get_expert_data_parallel_group()
        # megatron-core sets its embedding group only on the first and last stage (parallel_state.py: `if rank in
        # embedding_ranks`; a middle stage raises for it) and holds no tied weight there, as in asyncpp's own mesh.
        # By stage, not by ps.is_rank_in_embedding_group(): destroy_model_parallel() leaves that one's ranks
        # (_EMBEDDING_GLOBAL_RANKS) as they were, so after a re-initialization it can name a middle stage.
        ends = dims.pp > 1 and self.pp_rank in (0, dims.pp - 1) and not vocab_head
        self.embedding_group = ps.get_embedding_group() if ends else None
        self._check_megatron_layout()
        self.device_mesh = DeviceMesh.from_group(
            [self.pp_group, self.edp_group, self.ep_group, self.tp_group], device.type,
            mesh=torch.arange(dims.world_size).reshape(dims.pp, dims.edp, dims.ep, dims.tp),
            mesh_dim_names=("pp", "edp", "ep", "tp"))
        if self.norm_group_size == 1:
            self.norm_group = self.pp_group  # this rank alone: nothing is posted on it (norm_group_size gates it)
        else:
            self.norm_group = (ps.get_model_parallel_group() if dims.ep == 1
                               else ps.get_expert_tensor_model_pipeline_parallel_group())
        self.links = self._build_links()
        self.vocab_groups = None
        if vocab_head and dims.pp > 1:  # new_group is collective: every rank makes them here, in this order
            self.embedding_group = self._per_pipeline(list(range(dims.pp)))
            self.vocab_groups = self._vocab_groups(vocab_embedding)
        # Only the distributed optimizer (parallel.distributed_optimizer) posts on it; the Megatron front-end
        # has none, so no world-spanning group is made for it.
        self.replica_norm_group = None
        self._bound_groups(timeout_s if timeout_s is not None else _job_timeout_s(device))
        return self

    def _check_megatron_layout(self) -> None:
        """Every megatron group this mesh took holds exactly the ranks asyncpp's layout formula gives."""
        d, ep = self.dims, self.dims.ep
        expected = {
            "global rank": ([self.rank], [self.global_rank(self.pp_rank)]),
            "pipeline": (self.pp_group, [self.global_rank(s) for s in range(d.pp)]),
            "tensor-parallel": (self.tp_group, [self.global_rank(self.pp_rank, tp_rank=t) for t in range(d.tp)]),
            "data-parallel": (self.dp_group, [self.global_rank(self.pp_rank, r) for r in range(d.dp)]),
            "expert-parallel": (self.ep_group, [self.global_rank(self.pp_rank, self.edp_rank * ep + e)
                                                for e in range(ep)]),
            "expert-data-parallel": (self.edp_group, [self.global_rank(self.pp_rank, e * ep + self.ep_rank)
                                                      for e in range(d.edp)]),
        }
        if self.embedding_group is not None:
            expected["embedding"] = (self.embedding_group, [self.global_rank(0), self.global_rank(d.pp - 1)])
        for role, (group, ranks) in expected.items():
            got = group if isinstance(group, list) else dist.get_process_group_ranks(group)
            if got != ranks:
                raise ValueError(f"megatron-core's {role} group of rank {self.rank} holds ranks {got}, asyncpp's "
                                 f"layout expects {ranks}: initialize_model_parallel(order='tp-cp-ep-dp-pp') (its "
                                 "default) and the default embedding ranks")

    def _bound_groups(self, timeout_s: float) -> None:
        """Every group of this rank gets the job's timeout (init_distributed's train.timeout_s, which only the
        default group had: DeviceMesh and new_group give gloo 30 min, NCCL 10) and a description naming its
        roles, so a collective on it fails within train.timeout_s naming the stage, the group and the op
        (collectives.bounded). One group can play several roles (at pp=1 with ep=dp=2, the default group is
        the data- and the expert-parallel group)."""
        if dist.get_backend() == "fake":  # a dry run's groups never communicate
            return
        roles: dict[str, tuple[dist.ProcessGroup, list[str]]] = {}
        named = [("pipeline", self.pp_group), ("data-parallel", self.dp_group), ("tensor-parallel", self.tp_group),
                 ("expert-parallel", self.ep_group), ("expert-data-parallel", self.edp_group),
                 ("gradient-norm", self.norm_group), ("tied-embedding", self.embedding_group),
                 ("distributed-optimizer norm", self.replica_norm_group),
                 *((f"pipeline link ({field})", g) for field, g in vars(self.links).items()),
                 *((f"vocabulary-parallel head ({field})", g) for field, g in
                   (vars(self.vocab_groups).items() if self.vocab_groups is not None else ()))]
        for role, group in named:
            if group is not None and dist.get_world_size(group) > 1:
                roles.setdefault(group.group_name, (group, []))[1].append(role)
        where = f"stage {self.pp_rank} (rank {self.rank})"
        for group, names in roles.values():
            ranks = dist.get_process_group_ranks(group)
            bound_group(group, where=where, name=f"the {' and '.join(names)} group (ranks {ranks})",
                        timeout_s=timeout_s)

    def _norm_groups(self):
        """A new group per expert-data-parallel coordinate: its stages x EP x TP ranks (one replica of the
        model); returns this rank's. Always a communicator of its own, never one DeviceMesh hands out:
        reduction.progress() posts the norm all-reduce at the first action boundary where the DP sum has
        arrived, which is not the same action on every rank. At pp=1 the flattened ("pp", "ep", "tp")
        group was the EP or TP group itself (the default group when it spans the job), so with ep=2 one
        rank issued the norm all-reduce where the other issued the next forward's expert all-to-all, and
        both hung (issue 30). Collective: every rank creates every group in the same order."""
        if self.norm_group_size == 1:
            return self.pp_group  # this rank alone: nothing is ever posted on it (norm_group_size gates it)
        per_replica = self.device_mesh.mesh.transpose(0, 1).reshape(self.dims.edp, -1)  # [edp, pp*ep*tp]
        return self._new_groups(per_replica.tolist())

    def _per_pipeline(self, stages: list[int]):
        """A new group of `stages` in every pipeline (dp, tp coordinate); returns this rank's or None.
        new_group is collective over the whole world: every rank creates every group in the same order."""
        return self._new_groups([[self.global_rank(s, dp_rank, tp_rank) for s in stages]
                                 for dp_rank in range(self.dims.dp) for tp_rank in range(self.dims.tp)])

    def _per_data_replica(self):
        """A new group of every stage and TP rank of each DP coordinate (ranks in stage, then TP order); returns
        this rank's. Collective: every rank creates every group in the same order."""
        d = self.dims
        return self._new_groups([[self.global_rank(s, dp_rank, r) for s in range(d.pp) for r in range(d.tp)]
                                 for dp_rank in range(d.dp)])

    def _new_groups(self, rank_lists: list[list[int]]):
        """A new group for each list of global ranks, in order (new_group is collective over the whole world:
        every rank creates every group in the same order); returns the one this rank is in, or None."""
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _build_links(self) -> PipelineLinks:
        """Two 2-rank groups per link (s, s+1) of each pipeline: one carries the activations (s -> s+1),
        the other the gradients (s+1 -> s).

        Why one communicator per direction (and not batched send/recv pairs): on each of them one end
        only sends and the other only receives, in the schedule's FIFO order, so NCCL's "the ops of a
        pair run in issue order" can never queue a receive behind a send that waits for the other
        end. Deadlock freedom is then exactly the schedule's own (non-blocking sends, FIFO channels,
        checked without processes by asyncpp/schedules/invariants.py), for every schedule, warm-up,
        drain and stream switch, with no pairing logic, and a receive can be posted early on its own
        communicator without waiting for a matching send. The cost is 2(P-1) small communicators."""
        forward, backward = {}, {}
        for table in (forward, backward):
            for s in range(self.dims.pp - 1):
                table[s] = self._per_pipeline([s, s + 1])
        s = self.pp_rank
        return PipelineLinks(recv_forward=forward.get(s - 1), send_forward=forward.get(s),
                             recv_backward=backward.get(s), send_backward=backward.get(s - 1))

    def global_rank(self, pp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        dp_rank = self.dp_rank if dp_rank is None else dp_rank
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        return (pp_rank * self.dims.dp + dp_rank) * self.dims.tp + tp_rank

    @property
    def norm_group_size(self) -> int:
        return self.dims.pp * self.dims.tp * self.dims.ep

    @property
    def num_stages(self) -> int:
        return self.dims.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def is_writer(self) -> bool:
        """The one rank that writes metrics: last stage (it has the loss), dp 0, tp 0."""
        return self.is_last_stage and self.dp_rank == 0 and self.tp_rank == 0

    def describe(self) -> str:
        d = self.dims
        return f"pp={d.pp} dp={d.dp} (ep={d.ep} x edp={d.edp}) tp={d.tp}"


def _job_timeout_s(device: torch.device) -> float:
    """The default group's timeout: train.timeout_s, as init_distributed set it."""
    if dist.get_backend() == "fake":
        return 0.0  # unused: a dry run's groups are not bounded
    backend = dist.group.WORLD._get_backend(device)
    return backend.options._timeout.total_seconds()


def _elastic_store(timeout: timedelta) -> dict:
    """Under torchrun the workers share the agent's store across restarts. The default group's keys
    of a previous attempt (its ranks' dead addresses) would then be read by the next one, and gloo
    fails with "connectFullMesh ... Connection refused". Namespace the keys by restart attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout, use_libuv=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"asyncpp/attempt_{attempt}", client),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def init_distributed(device_type: str = "cpu", timeout_s: float = 300.0) -> torch.device:
    """Initialize the default process group from torchrun's environment; returns this rank's device.
    `timeout_s` bounds every collective, so a dead rank turns into an error instead of a hang."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        # On CUDA, bind the device (eager communicator init, torch's recommendation): unbatched p2p
        # then uses its group's own communicator, which is why every group carries one kind of traffic.
        bind = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=default_backend(device), timeout=timeout, **bind, **_elastic_store(timeout))
    return device
