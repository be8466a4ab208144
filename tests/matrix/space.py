"""The feature space a user can configure, as data: dimensions, their values, and the config each case means.

The config validator is the oracle of what is allowed (asyncpp.job.resolve, then the pipeline's own checks,
check_pipeline_options, both before any process group exists): a case it accepts must run as a real pipeline
and equal the simulator; a case it refuses must be refused with a ConfigError that names the field.
"""

from __future__ import annotations

from asyncpp.pipeline.stopping import stop_lookahead

MAX_RANKS = 4
"""gloo processes one case may start on the test machine (2 cores)."""

DIMENSIONS: dict[str, tuple] = {
    "schedule": ("2bw", "1f1b", "pipedream", "sync", "gpipe"),
    "optimizer": ("adamw", "muon"),
    "model": ("tiny_dense", "tiny_moe", "tiny_hybrid"),  # dense tied, MoE, hybrid (GDN + attention + MoE)
    "ef_lambda": (0.0, 1.0),
    "sync_start_steps": (0, 1),
    "grad_ef_lambda": (0.0, 0.5),
    "dc_lambda": (0.0, 0.1),
    "weight_prediction": (False, True),
    "pp": (1, 2, 3, 4),
    "tp": (1, 2),
    "sequence_parallel": (False, True),
    "dp": (1, 2),
    "ep": (1, 2),
    "distributed_optimizer": (False, True),
    "precision": ("fp32", "bf16"),
    "recompute": ("none", "selective", "full"),
    # The LM head's placement, parallel.head: on the last stage, its vocabulary spread over every stage (issue 28),
    # or the cost model's choice between last and vocab.
    "head": ("last", "vocab", "auto"),
    # The input embedding's placement, parallel.embedding: whole on the first stage, or sharded by the vocabulary-
    # parallel head's rows (with head=vocab, or auto resolved to it).
    "embedding": ("first", "vocab"),
    "rampup": (False, True),
    "m": ("P", "P+1", "2P"),  # microbatches per replica: the pipeline's depth, one more, or twice it
    "resume": (False, True),  # a stop requested mid-run (checkpointed), then the same command resumes it
}


LAYERLESS: dict[str, dict] = {
    "last-stage-only-norm-and-head": {"pp": 3, "stage_layers": [3, 1, 0]},
    "issue-layout-vocab-head": {"pp": 4, "head": "vocab", "stage_layers": [2, 2, 0, 0], "schedule": "1f1b"},
    "first-stage-only-embedding-rows": {"pp": 3, "head": "vocab", "embedding": "vocab", "stage_layers": [0, 2, 2],
                                        "m": "P+1"},
    "moe-middle-layerless-muon": {"pp": 3, "model": "tiny_moe", "optimizer": "muon", "head": "vocab",
                                  "embedding": "vocab", "stage_layers": [2, 0, 2], "schedule": "1f1b", "m": "2P"},
    "last-layerless-dp-zero-resume": {"pp": 2, "dp": 2, "head": "vocab", "distributed_optimizer": True,
                                      "stage_layers": [4, 0], "resume": True},
    "hybrid-auto-head-layerless": {"pp": 4, "model": "tiny_hybrid", "head": "auto", "stage_layers": [1, 2, 1, 0],
                                   "ef_lambda": 1.0},
}
"""Issue 44: layouts with stages that hold no layer (parallel.stage_layers with zeros: a pass-through middle stage, a
last stage of only the final norm and head (rows), a first stage of only the embedding (rows)), as named cases on top
of the cover, each the first value of every dimension but the ones named. Not a dimension: a stage_layers dimension
would redraw every case of the seeded cover (cover.json) for a value that only means something at pp >= 2 with
the model's 4 layers, and its pairs with most dimensions say nothing a named case does not."""


def layerless_cases() -> dict[str, dict]:
    return {name: {**{d: values[0] for d, values in DIMENSIONS.items()}, **over} for name, over in LAYERLESS.items()}


def world(case: dict) -> int:
    return case.get("pp", 1) * case.get("tp", 1) * case.get("dp", 1)


def feasible(case: dict) -> bool:
    """The machine's limit only (unset dimensions count as 1): what the validator refuses stays in the space.
    One rank is no pipeline (pretrain runs the simulator itself), so a complete case has 2 ranks at least."""
    complete = all(d in case for d in ("pp", "tp", "dp"))
    return world(case) <= MAX_RANKS and (not complete or world(case) >= 2)


def microbatches(case: dict) -> int:
    depth = max(case["pp"], 2)
    return {"P": depth, "P+1": depth + 1, "2P": 2 * depth}[case["m"]]


def steps(case: dict) -> int:
    """4 steps; a case with a stop runs long enough that the stop requested at step 0 (tests/matrix/run.py) lands
    mid-run with two steps left to resume: at 1 + the largest stage delay in the steady state."""
    return max(4, stop_lookahead(case["schedule"], case["pp"]) + 2) if case["resume"] else 4


def container(case: dict, checkpoint_dir: str = "checkpoints") -> dict:
    """The case as the plain config dict pretrain composes (tests/dist/workers.make_config's base)."""
    m = microbatches(case)
    train = {"steps": steps(case), "micro_batch_size": 2, "num_microbatches": m, "seq_len": 16, "eval_every": 0,
             "grad_clip": 1.0, "recompute": case["recompute"], "precision": case["precision"], "timeout_s": 60.0}
    if case["rampup"]:
        # Megatron's rule: start at half the batch (whole microbatches per replica), grow by one microbatch per
        # replica every `samples` sequences until the full batch; the steps of each m form a segment of their own.
        step = train["micro_batch_size"] * case["dp"]
        train["batch_rampup"] = [max(1, m // 2) * step, step, m * step]
    return {
        "model": {"name": case["model"]},
        "train": train,
        "optimizer": {"name": case["optimizer"], "lr": 0.02 if case["optimizer"] == "muon" else 1e-3,
                      "schedule": {"kind": "constant", "warmup_steps": 0}},
        "schedule": {"name": case["schedule"]},
        "staleness": {"ef_lambda": case["ef_lambda"], "sync_start_steps": case["sync_start_steps"],
                      "grad_ef_lambda": case["grad_ef_lambda"], "dc_lambda": case["dc_lambda"],
                      "weight_prediction": case["weight_prediction"]},
        "parallel": {"pp": case["pp"], "tp": case["tp"], "dp": case["dp"], "ep": case["ep"],
                     "sequence_parallel": case["sequence_parallel"],
                     "distributed_optimizer": case["distributed_optimizer"],
                     "head": case["head"], "embedding": case["embedding"],
                     **({"stage_layers": case["stage_layers"]} if "stage_layers" in case else {})},
        "logging": {"wandb_mode": "disabled", "progress": False},
        # A case with a stop checkpoints only where the stop lands (every=0, timed saves off) and resumes from it.
        "checkpoint": ({"enabled": True, "every": 0, "every_minutes": 0.0, "dir": checkpoint_dir}
                       if case["resume"] else {"enabled": False}),
    }


def label(case: dict) -> str:
    """A short, stable test id: the values that differ from each dimension's first."""
    diff = [f"{k}={v}" for k, v in case.items() if k not in DIMENSIONS or v != DIMENSIONS[k][0]]
    return ",".join(diff) or "defaults"
