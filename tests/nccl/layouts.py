"""The layouts the replay tier records: every schedule at P=2, 3, 4 and the features that add
communication (DP, TP, EP, tied embeddings, an evaluation drain, a checkpoint save, synchronous
start/cooldown, the Megatron-style loop). Each runs for real on gloo, recording every rank's ops."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import torch

from asyncpp.config import RunConfig
from asyncpp.parallel.mesh import Mesh, ParallelDims
from tests.dist.harness import run_ranks
from tests.dist.workers import make_config, pipeline_rank
from tests.nccl.recorder import record


@dataclass(frozen=True)
class Layout:
    name: str
    cfg: RunConfig
    megatron: bool = False
    stop: tuple[int, int] | None = None
    """(rank, step): that rank requests a stop at that step (StopFlag's test hook), mid-segment."""
    example: tuple[str, ...] | None = None
    """examples/megatron_2bw.py's command line: its loop is recorded (cfg then only gives the world size); {tmp} is a
    temporary directory (its --save)."""

    @property
    def world(self) -> int:
        p = self.cfg.parallel
        return p.pp * (p.dp or 1) * p.tp


def _schedule(kind: str, P: int) -> Layout:
    """Every schedule with a tied embedding (all tiny models tie it), an evaluation drain after step 2,
    and, for the delayed kinds, one synchronous step at each end (two stream switches)."""
    staleness = {"sync_start_steps": 1, "sync_cooldown_steps": 1} if kind in ("2bw", "pipedream") else {}
    split = {"stage_layers": [2, 1, 1]} if P == 3 else {}  # tiny models have 4 layers
    cfg = make_config(parallel={"pp": P, **split}, schedule={"name": kind},
                      train={"steps": 5, "num_microbatches": max(P, 3), "eval_every": 2, "eval_batches": 1},
                      staleness=staleness)
    return Layout(f"{kind}-P{P}", cfg)


_UNTIED = {"name": "tiny_dense", "overrides": {"tie_embeddings": False}}


def _layouts() -> dict[str, Layout]:
    out = {}
    for kind in ("1f1b", "gpipe", "2bw", "pipedream"):
        for P in (2, 3, 4):
            layout = _schedule(kind, P)
            out[layout.name] = layout
    short = {"steps": 4, "num_microbatches": 2, "eval_every": 0}
    extra = [
        Layout("2bw-P2-DP2", make_config(parallel={"pp": 2, "dp": 2}, train={**short, "eval_every": 2},
                                         staleness={"sync_start_steps": 1})),
        Layout("1f1b-P2-DP2", make_config(parallel={"pp": 2, "dp": 2}, schedule={"name": "1f1b"}, train=short)),
        Layout("2bw-P2-TP2", make_config(model={"name": "tiny_moe"}, parallel={"pp": 2, "tp": 2}, train=short)),
        Layout("2bw-P2-EP2", make_config(model={"name": "tiny_moe"}, parallel={"pp": 2, "dp": 2, "ep": 2},
                                         train=short)),
        # One stage (issue 30): the norm all-reduce, posted at a timing-dependent action, shared the EP (the
        # TP) group with the forward's all-to-alls (all-reduces) until it got a group of its own.
        Layout("2bw-P1-DP2-EP2", make_config(model={"name": "tiny_moe"}, parallel={"pp": 1, "dp": 2, "ep": 2},
                                             train=short)),
        Layout("2bw-P1-TP2", make_config(model={"name": "tiny_moe"}, parallel={"pp": 1, "tp": 2}, train=short)),
        # The distributed optimizer: reduces to the owners, the broadcast of x_{t+1} waited for at its first
        # read, the norm over the whole job; with an evaluation drain and a checkpoint of the sharded state.
        Layout("2bw-P2-DP2-zero", make_config(parallel={"pp": 2, "dp": 2, "distributed_optimizer": True},
                                              train={**short, "eval_every": 2}, staleness={"ef_lambda": 1.0},
                                              checkpoint={"enabled": True, "every": 2})),
        # bf16: the owners' masters sharded too, x_{t+1} broadcast in bf16; the checkpoint saves the masters
        # from their owners only.
        Layout("2bw-P2-DP2-zero-bf16", make_config(parallel={"pp": 2, "dp": 2, "distributed_optimizer": True},
                                                   train={**short, "precision": "bf16"}, staleness={"ef_lambda": 1.0},
                                                   checkpoint={"enabled": True, "every": 2})),
        Layout("2bw-P2-EP2-zero", make_config(model={"name": "tiny_moe"},
                                              parallel={"pp": 2, "dp": 2, "ep": 2, "distributed_optimizer": True},
                                              train=short)),
        Layout("2bw-P2-checkpoint", make_config(parallel={"pp": 2}, train=short,
                                                checkpoint={"enabled": True, "every": 2})),
        Layout("2bw-P2-stop-midsegment", make_config(parallel={"pp": 2}, train={**short, "steps": 9},
                                                     checkpoint={"enabled": True, "every": 0}), stop=(1, 1)),
        # A batch rampup: m = 2, 2, 3, 3, 4 (segments cut at steps 2 and 4, each stream with its own m).
        Layout("2bw-P2-rampup", make_config(parallel={"pp": 2}, train={"steps": 5, "micro_batch_size": 2,
                                                                     "num_microbatches": 4, "batch_rampup": [4, 2, 16]})),
        # parallel.head=vocab: three groups over all the stages (the hidden states' broadcast, the statistics'
        # all-gather, the input gradient's reduce), posted at S and T actions the cost model places; with a sync
        # start, an evaluation drain (blocking head passes) and a checkpoint of the head's rows.
        Layout("2bw-P2-vocab", make_config(model=_UNTIED, parallel={"pp": 2, "head": "vocab"},
                                           train={**short, "steps": 5, "eval_every": 2},
                                           staleness={"sync_start_steps": 1},
                                           checkpoint={"enabled": True, "every": 2})),
        # Tied: the later stages' rows are reduced with the first stage's embedding over the whole pipeline.
        Layout("1f1b-P4-vocab", make_config(parallel={"pp": 4, "head": "vocab"}, schedule={"name": "1f1b"},
                                            train={**short, "num_microbatches": 4})),
        Layout("2bw-P4-vocab", make_config(parallel={"pp": 4, "head": "vocab"},
                                           train={**short, "num_microbatches": 5, "eval_every": 2},
                                           staleness={"ef_lambda": 1.0})),
        Layout("2bw-P2-DP2-vocab-zero", make_config(parallel={"pp": 2, "dp": 2, "head": "vocab",
                                                              "distributed_optimizer": True},
                                                    train=short, staleness={"ef_lambda": 1.0},
                                                    checkpoint={"enabled": True, "every": 2})),
        # Stages without layers (issue 44): stage 2 passes its input on, stage 3 holds the final norm and the head
        # rows only; their tied rows' reduction and norm all-reduce are still called by every member.
        Layout("2bw-P4-vocab-layerless", make_config(parallel={"pp": 4, "head": "vocab", "stage_layers": [2, 2, 0, 0]},
                                                     train={**short, "num_microbatches": 4})),
        # With TP and SP: the statistics' group spans both stages' TP ranks; the last stage's sequence all-gather
        # (TP group) sits between its forward and the broadcast, its reduce-scatter in the backward.
        Layout("2bw-P2-TP2-SP-vocab", make_config(model=_UNTIED, parallel={"pp": 2, "tp": 2, "head": "vocab",
                                                                           "sequence_parallel": True},
                                                  train={**short, "eval_every": 2},
                                                  checkpoint={"enabled": True, "every": 2})),
        Layout("2bw-P2-vocab-stop-midsegment", make_config(parallel={"pp": 2, "head": "vocab"},
                                                           train={**short, "steps": 9},
                                                           checkpoint={"enabled": True, "every": 0}), stop=(1, 1)),
        # parallel.embedding=vocab: two more groups over all the stages (the partial lookups' reduce onto the first
        # stage, the first stage's input gradient broadcast back), posted at E and G actions the cost model places,
        # with UPDATEs pulled up ahead of the Es that read their version; a sync start, an evaluation drain (blocking
        # lookups) and a checkpoint of the embedding's rows.
        Layout("2bw-P2-vocab-embedding", make_config(model=_UNTIED, parallel={"pp": 2, "head": "vocab",
                                                                              "embedding": "vocab"},
                                                     train={**short, "steps": 5, "eval_every": 2},
                                                     staleness={"sync_start_steps": 1},
                                                     checkpoint={"enabled": True, "every": 2})),
        # Tied (one tensor per stage, no tied all-reduce), P=4 with DP=2 and the distributed optimizer, EF.
        Layout("2bw-P4-DP2-vocab-embedding-zero", make_config(parallel={"pp": 4, "dp": 2, "head": "vocab",
                                                                        "embedding": "vocab",
                                                                        "distributed_optimizer": True},
                                                              train={**short, "num_microbatches": 4, "eval_every": 2},
                                                              staleness={"ef_lambda": 1.0})),
        Layout("2bw-P2-vocab-embedding-stop-midsegment",
               make_config(parallel={"pp": 2, "head": "vocab", "embedding": "vocab"}, train={**short, "steps": 9},
                           checkpoint={"enabled": True, "every": 0}), stop=(1, 1)),
        Layout("megatron-2bw-P2", make_config(parallel={"pp": 2}, schedule={"name": "2bw"},
                                              train={"steps": 4, "num_microbatches": 2}), megatron=True),
        Layout("megatron-1f1b-P3", make_config(model={"name": "tiny_dense", "overrides": {"num_layers": 3}},
                                               parallel={"pp": 3}, schedule={"name": "1f1b"},
                                               train={"steps": 3, "num_microbatches": 3}), megatron=True),
    ]
    # examples/megatron_2bw.py: megatron-core's GPTModel and parallel_state (Mesh.from_megatron: megatron's groups
    # plus asyncpp's per-direction links), a tied embedding over megatron's embedding group, evaluation drains.
    example = ("--train-iters", "5", "--eval-interval", "2", "--num-layers", "2", "--hidden-size", "32",
               "--seq-length", "16", "--micro-batch-size", "2", "--num-microbatches", "2")
    extra += [
        Layout("megatron-core-example-P2", make_config(parallel={"pp": 2}),
               example=(*example, "--ef-lambda", "1", "--sync-start-steps", "1", "--save", "{tmp}/ckpt",
                        "--save-interval", "2")),  # its checkpoints' collectives (DCP, the manifest's RNG gather)
        Layout("megatron-core-example-P2-TP2", make_config(parallel={"pp": 2, "tp": 2}),
               example=(*example, "--tp", "2", "--optimizer", "muon")),
        # every staleness option through the front-end (a third weight version, DC-ASGD's read of it, gradient EF)
        Layout("megatron-core-example-P2-TP2-corrections", make_config(parallel={"pp": 2, "tp": 2}),
               example=(*example, "--tp", "2", "--weight-prediction", "--dc-lambda", "1", "--grad-ef-lambda", "0.5",
                        "--sync-start-steps", "1")),
        # megatron's sequence parallelism (the TP all-reduce of the SP norms' partial gradients in the reduction)
        Layout("megatron-core-example-P2-TP2-SP", make_config(parallel={"pp": 2, "tp": 2}),
               example=(*example, "--tp", "2", "--sequence-parallel")),
        # four stages: two middle ones outside megatron's embedding group (the tied weight on stages 0 and 3 only)
        Layout("megatron-core-example-P4", make_config(parallel={"pp": 4}),
               example=("--train-iters", "5", "--eval-interval", "2", "--num-layers", "4", "--hidden-size", "32",
                        "--seq-length", "16", "--micro-batch-size", "2", "--num-microbatches", "4", "--pp", "4",
                        "--weight-prediction")),
        # the output layer spread over the four stages (VocabPipeline2BW: S/T on every stage, evaluation drains)
        Layout("megatron-core-example-P4-vocab-head", make_config(parallel={"pp": 4}),
               example=("--train-iters", "5", "--eval-interval", "2", "--num-layers", "4", "--hidden-size", "32",
                        "--seq-length", "16", "--micro-batch-size", "2", "--num-microbatches", "4", "--pp", "4",
                        "--vocab-parallel-head", "--weight-prediction")),  # tied: the rows' all-stage reduction
        # ... and the input embedding sharded too (E/G on every stage; the broadcasts' receivers in one call)
        Layout("megatron-core-example-P4-vocab-embedding", make_config(parallel={"pp": 4}),
               example=("--train-iters", "5", "--eval-interval", "2", "--num-layers", "4", "--hidden-size", "32",
                        "--seq-length", "16", "--micro-batch-size", "2", "--num-microbatches", "4", "--pp", "4",
                        "--vocab-parallel-head", "--vocab-parallel-embedding")),
        # ... under the flushed 1F1B baseline (every call the head's placed stream of its one step, update included)
        Layout("megatron-core-example-P4-vocab-embedding-1f1b", make_config(parallel={"pp": 4}),
               example=("--train-iters", "5", "--eval-interval", "2", "--num-layers", "4", "--hidden-size", "32",
                        "--seq-length", "16", "--micro-batch-size", "2", "--num-microbatches", "4", "--pp", "4",
                        "--vocab-parallel-head", "--vocab-parallel-embedding", "--schedule", "1f1b")),
        # the output layer spread over the stages and each stage's rows over its TP ranks, with SP (the statistics
        # gathered over every stage and TP rank, the head's input entering the TP region) and a checkpoint of the rows
        Layout("megatron-core-example-P2-TP2-SP-vocab-head", make_config(parallel={"pp": 2, "tp": 2}),
               example=(*example, "--tp", "2", "--sequence-parallel", "--vocab-parallel-head",
                        "--untie-embeddings-and-output-weights", "--save", "{tmp}/ckpt", "--save-interval", "2")),
        # MoE with megatron's alltoall dispatcher over EP=2 (its all-to-alls inside every forward and backward)
        Layout("megatron-core-example-P2-DP2-EP2-alltoall", make_config(parallel={"pp": 2, "dp": 2}),
               example=(*example, "--num-experts", "4", "--expert-model-parallel-size", "2",
                        "--moe-token-dispatcher-type", "alltoall")),
        # ... with the output layer and the input embedding spread over the stages (VocabPipeline2BW): the EP
        # all-to-alls inside F/B between the head's and the embedding's all-stage collectives, per-call windows
        Layout("megatron-core-example-P2-DP2-EP2-alltoall-vocab", make_config(parallel={"pp": 2, "dp": 2}),
               example=(*example, "--num-experts", "4", "--expert-model-parallel-size", "2",
                        "--moe-token-dispatcher-type", "alltoall", "--vocab-parallel-head",
                        "--vocab-parallel-embedding")),
        # megatron's router expert bias (its token counts riding the DP gradient all-reduce) and its checkpoint
        Layout("megatron-core-example-P2-DP2-router-bias", make_config(parallel={"pp": 2, "dp": 2}),
               example=(*example, "--num-experts", "4", "--moe-router-score-function", "sigmoid",
                        "--moe-router-enable-expert-bias", "--save", "{tmp}/ckpt", "--save-interval", "2")),
    ]
    out.update({layout.name: layout for layout in extra})
    return out


LAYOUTS = _layouts()
FAST = ("2bw-P2-DP2", "1f1b-P3", "megatron-2bw-P2", "megatron-core-example-P2", "2bw-P2-stop-midsegment",
        "2bw-P2-DP2-zero", "2bw-P2-rampup", "2bw-P2-head-split", "2bw-P2-vocab", "2bw-P2-vocab-embedding",
        "megatron-core-example-P4-vocab-head", "megatron-core-example-P4-vocab-embedding")
"""Recorded in the default suite (2BW with DP, tied embeddings, a sync start and an evaluation drain; a
middle stage; the Megatron loop, with asyncpp's stages and with megatron-core's (the example); a stream cut short
by a stop; the distributed optimizer; a batch rampup's streams of different m; the head split; the
vocabulary-parallel head, and with the embedding sharded too; megatron-core's output layer spread over 4 stages
through the front-end's per-call windows, and its embedding too); the rest is `slow`."""


def recorded_pipeline(rank: int, cfg_dict: dict) -> list:
    with record() as recorder:
        pipeline_rank(rank, cfg_dict)
    return recorder.log


def recorded_stopped_pipeline(rank: int, cfg_dict: dict, requester: int, at_step: int) -> list:
    from tests.dist.test_stop_midsegment import stopped_rank

    with record() as recorder:
        stopped_rank(rank, cfg_dict, requester, at_step)
    return recorder.log


def recorded_megatron(rank: int, cfg_dict: dict) -> list:
    from tests.dist.test_megatron_api import loss_func, train_and_evaluate

    cfg = RunConfig.from_dict(cfg_dict)
    with record() as recorder:
        mesh = Mesh(ParallelDims(pp=cfg.parallel.pp).validate(torch.distributed.get_world_size()),
                    torch.device("cpu"))
        train_and_evaluate(cfg, mesh, loss_func)
    return recorder.log


def recorded_example(rank: int, argv: tuple[str, ...]) -> list:
    from examples.megatron_2bw import parse_args, train

    with record() as recorder:
        train(parse_args(list(argv)))
    return recorder.log


def record_layout(layout: Layout) -> dict[int, list]:
    """Run the layout on gloo; rank -> its ops in issue order."""
    cfg = layout.cfg
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.checkpoint.enabled:
            cfg = cfg.replace(checkpoint=cfg.checkpoint.__class__(**{**cfg.checkpoint.__dict__, "dir": tmp}))
        if layout.example is not None:
            argv = tuple(a.replace("{tmp}", tmp) for a in layout.example)
            logs = run_ranks(recorded_example, layout.world, argv, timeout=600)
        elif layout.stop is not None:
            logs = run_ranks(recorded_stopped_pipeline, layout.world, cfg.to_dict(), *layout.stop, timeout=600)
        else:
            fn = recorded_megatron if layout.megatron else recorded_pipeline
            logs = run_ranks(fn, layout.world, cfg.to_dict(), timeout=600)
    return dict(enumerate(logs))
