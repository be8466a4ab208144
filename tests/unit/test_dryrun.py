"""dry_run=N lays a job out at N ranks on a fake process group: real mesh, real shard shapes, per-rank memory."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from asyncpp import job
from model_zoo import build_model, get_model_config


def dry(overrides: list[str], tmp_path) -> list[dict]:
    cfg, model_cfg = job.resolve(job.compose(overrides + ["logging=disabled", f"out_dir={tmp_path}"]))
    said: list[str] = []
    reports = job.run_dry(cfg, model_cfg, echo=said.append)
    progress = [line for line in said if line.startswith("dry run: stage ")]  # one line before each stage's build
    assert [line.split(" (rank")[0] for line in progress] == [
        f"dry run: stage {s + 1} of {len(reports)}" for s in range(len(reports))]
    assert (tmp_path / "dry_run.json").is_file()
    assert not dist.is_initialized(), "the fake process group must be torn down"
    return reports


def test_tiny_moe_layout_shapes_every_shard(tmp_path):
    full = get_model_config("tiny_moe")
    reports = dry(["model=tiny_moe", "parallel.pp=2", "parallel.tp=2", "parallel.ep=2", "dry_run=8",
                   "optimizer=adamw", "staleness.ef_lambda=1.0"], tmp_path)
    assert [r["stage"] for r in reports] == [0, 1]
    first, last = reports[0]["shards"], reports[1]["shards"]
    heads = full.num_heads * full.head_dim
    assert first["embed.weight"]["shape"] == [full.vocab_size // 2, full.hidden_size]
    assert first["layers.0.mixer.q_proj.weight"]["shape"] == [heads // 2, full.hidden_size]
    assert first["layers.0.mixer.o_proj.weight"]["shape"] == [full.hidden_size, heads // 2]
    e, f = full.moe.num_experts, full.moe.expert_ffn_hidden_size
    assert first["layers.0.mlp.w_gate"]["shape"] == [e // 2, f // 2, full.hidden_size]
    assert first["layers.0.mlp.w_gate"]["expert"] and first["layers.0.mlp.w_gate"]["tp_dim"] == 1
    assert first["layers.0.mlp.router.weight"]["shape"] == [e, full.hidden_size]  # replicated
    assert "lm_head.weight" in last or "embed.weight" in last


def test_memory_items_follow_from_the_shard_shapes(tmp_path):
    reports = dry(["model=tiny_moe", "parallel.pp=2", "parallel.tp=2", "parallel.ep=2", "dry_run=8",
                   "optimizer=adamw", "staleness.ef_lambda=1.0", "train.precision=bf16"], tmp_path)
    for r in reports:
        numel = sum(math.prod(s["shape"]) for s in r["shards"].values())
        assert numel == r["params"]
        items = {i["name"].split(" (")[0]: i["bytes"] for i in r["memory"]["items"]}
        assert items["weight versions"] == 2 * 2 * numel   # two bf16 versions (2BW)
        assert items["fp32 master weights"] == 4 * numel
        assert items["error feedback buffer"] == 4 * numel
        assert items["optimizer state"] >= 2 * 4 * numel     # AdamW: exp_avg + exp_avg_sq (+ step scalars)


def test_sharded_parameters_add_up_to_the_model(tmp_path):
    """Every parameter of moe_2b is on exactly one (stage, tp, ep) shard: the per-rank counts of a
    pp=2 x ep=4 layout, scaled back by the shards, give the model's total."""
    cfg = get_model_config("moe_2b")
    reports = dry(["model=moe_2b", "parallel.pp=2", "parallel.ep=4", "dry_run=8", "optimizer=adamw",
                   "train.num_microbatches=4"], tmp_path)  # per replica (dp=4): the default global batch is 4 mbs
    total = 0
    for r in reports:
        for s in r["shards"].values():
            total += math.prod(s["shape"]) * (4 if s["expert"] else 1)
    model = build_model(cfg, device="meta")
    assert total == sum(p.numel() for p in model.parameters())


def test_ep_must_divide_dp_before_anything_is_built(tmp_path):
    with pytest.raises(Exception, match="parallel.ep=4 does not divide the 2 data-parallel ranks"):
        dry(["model=tiny_moe", "parallel.pp=2", "parallel.ep=4", "dry_run=4"], tmp_path)


def test_distributed_optimizer_under_bf16_plans_the_owned_share_of_the_masters(tmp_path):
    """The masters, the fp32 copy of x_t and the EF buffer are all the owned parameters' (DP rank 0's share):
    the same bytes, below the whole stage's, which the run without the distributed optimizer keeps."""
    base = ["model=tiny_dense", "parallel.pp=2", "dry_run=8", "optimizer=adamw", "staleness.ef_lambda=1.0",
            "train.precision=bf16", "train.num_microbatches=4"]  # per replica (dp=4)
    def items(flag: str, sub) -> list[dict]:
        return [{i["name"].split(" (")[0]: i["bytes"] for i in r["memory"]["items"]}
                for r in dry(base + [f"parallel.distributed_optimizer={flag}"], tmp_path / sub)]
    for sharded, whole in zip(items("true", "a"), items("false", "b")):
        assert sharded["fp32 master weights"] == sharded["error feedback buffer"] == sharded["update scratch"]
        assert 0 < sharded["fp32 master weights"] < whole["fp32 master weights"] == whole["error feedback buffer"]
        assert sharded["optimizer state"] < whole["optimizer state"]


@pytest.mark.slow  # two stages' traced steps on meta: 100 s of the default suite (tests/dist/test_layerless_stages.py
# and the NCCL layout 2bw-P4-vocab-layerless are its slow twins; the reduction's empty call is the same code)
def test_layerless_stages_run_their_training_step_in_the_dry_run(tmp_path):
    """parallel.stage_layers with zeros (issue 44): the layout alone passed while the real run crashed at the
    layer-less stage's first UPDATE_START; the dry run now executes those stages' steps (on meta tensors)."""
    reports = dry(["model=tiny_dense", "parallel.pp=6", "parallel.stage_layers=[1,1,1,1,0,0]", "parallel.head=vocab",
                   "train.num_microbatches=6", "dry_run=6"], tmp_path)
    assert [r["layers"] for r in reports] == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 4], [4, 4]]
    for r in reports:
        traced = r.get("traced_actions", [])
        assert bool(traced) == (r["stage"] >= 4), r["stage"]
        if traced:  # the actions that crashed the run ran, with the head's S and T passes
            assert {"U00", "U01", "U0"} <= set(traced) and any(a.startswith("S") for a in traced), traced
            # only vocabulary rows (and the last stage's final norm)
            assert set(r["shards"]) == {"lm_head.weight"} | ({"norm.weight"} if r["stage"] == 5 else set())


def _rows(report: dict) -> dict[str, int]:
    """name -> bytes, the name up to its first " (" or " of" (the shape and count details)."""
    return {i["name"].split(" (")[0].split(" of ")[0]: i["bytes"] for i in report["memory"]["items"]}


@pytest.mark.parametrize("extra", [[], ["parallel.dp=2", "parallel.distributed_optimizer=true"]], ids=["pp", "zero1"])
def test_no_error_feedback_buffer_at_lambda_zero(extra, tmp_path):
    """ef_lambda=0 allocates no u_{t-1} (ErrorFeedback never reads it) and the plan agrees: the same layout at λ=1
    holds one fp32 copy of the parameters this rank updates (its ZeRO-1 share with the distributed optimizer), and
    every other held item is unchanged; the total drops by the buffer, plus the update's EF scratch where UPDATE is
    the peak action."""
    base = ["model=tiny_hybrid", "parallel.pp=2", "train.precision=bf16", "optimizer=adamw", *extra]
    on = dry(base + [f"dry_run={2 * (2 if extra else 1)}", "staleness.ef_lambda=1.0"], tmp_path / "on")
    off = dry(base + [f"dry_run={2 * (2 if extra else 1)}", "staleness.ef_lambda=0"], tmp_path / "off")
    assert len(on) == len(off) == 2
    for a, b in zip(on, off):
        rows_on, rows_off = _rows(a), _rows(b)
        assert rows_off["error feedback buffer"] == 0 and rows_off["update scratch: error feedback's u_t"] == 0
        owned = rows_on["fp32 master weights"]  # the masters this rank steps (a DP share under ZeRO-1)
        assert rows_on["error feedback buffer"] == owned > 0
        if extra:
            assert owned < 4 * a["params"]  # the buffer really is sharded: the mechanism under test ran
        same = {k: v for k, v in rows_on.items() if not k.startswith(("error feedback", "update scratch: error"))}
        assert same == {k: v for k, v in rows_off.items() if k in same}
        drop = a["memory"]["total_bytes"] - b["memory"]["total_bytes"]
        assert owned <= drop <= owned + rows_on["update scratch: error feedback's u_t"]
