"""asyncpp/train/checkpoint/size.py: the size of a checkpoint computed from shapes equals the tensors a run wrote.

Each case trains 2 steps in one process (the simulator: the same checkpoint keys as the pipeline's) and reads the
byte count of every tensor in the checkpoint's DCP index; the computed size must equal it exactly, and each part
must be there (or absent) as the config says, so a wrong dtype, a missing weight version, an EF buffer counted when
off or an optimizer's state miscounted would fail."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint import FileSystemReader

from asyncpp import job
from asyncpp.train import checkpoint as ckpt
from asyncpp.train.checkpoint.size import checkpoint_size

SMALL = ["logging=disabled", "logging.progress=false", "train.eval_every=0", "train.micro_batch_size=1",
         "train.num_microbatches=2", "train.seq_len=16", "train.steps=2", "checkpoint.every=2"]
CASES = {  # the first two: the recipes' kind of run (2BW, EF, Muon, bf16) and the synchronous baseline
    "2bw_ef_muon_bf16": ["model=tiny_dense", "schedule=2bw", "parallel.pp=2", "staleness.ef_lambda=1",
                         "optimizer=muon", "train.precision=bf16"],
    "sync_adamw": ["model=tiny_dense", "schedule=sync", "staleness.ef_lambda=0", "optimizer=adamw"],
    "2bw_prediction_gef_adamw": ["model=tiny_dense", "schedule=2bw", "parallel.pp=2", "staleness.ef_lambda=0",
                                 "staleness.grad_ef_lambda=0.5", "staleness.weight_prediction=true",
                                 "optimizer=adamw"],
    # (not with weight prediction: the simulator then keeps one router-bias version fewer than the pipeline, whose
    # count size.py gives: one per weight version)
    "2bw_moe_bias": ["model=tiny_moe", "schedule=2bw", "parallel.pp=2", "staleness.ef_lambda=1", "optimizer=adamw",
                     "+model.overrides={moe: {bias_update_rate: 0.001}}"],
}
SLOW = {"2bw_prediction_gef_adamw", "2bw_moe_bias"}  # 15-30 s each on a loaded 2-core box


def written_bytes(path) -> dict[str, int]:
    """Bytes of every tensor in the checkpoint, by its key's first part (weights/<age>, ef, optim, ...)."""
    out: dict[str, int] = {}
    for key, meta in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items():
        if not hasattr(meta, "size"):
            continue  # a non-tensor entry
        parts = key.split("/")
        part = "/".join(parts[:2]) if parts[0] in ("weights", "balancing") else parts[0]
        n = meta.properties.dtype.itemsize
        for d in meta.size:
            n *= d
        out[part] = out.get(part, 0) + n
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES])
def test_computed_size_equals_what_a_run_wrote(tmp_path, name):
    cfg, model_cfg = job.resolve(job.compose([*SMALL, *CASES[name], f"out_dir={tmp_path}"]))
    job.run(cfg, model_cfg)
    wrote = written_bytes(ckpt.latest(tmp_path / "checkpoints"))
    size = checkpoint_size(cfg, model_cfg)
    assert size.total == sum(wrote.values()), (size, wrote)
    assert size.newest == wrote["weights/0"]
    assert size.older == sum(v for k, v in wrote.items() if k.startswith("weights/") and k != "weights/0")
    assert size.versions == 1 + sum(k.startswith("weights/") and k != "weights/0" for k in wrote)
    assert size.error_feedback == wrote.get("ef", 0) + wrote.get("gef", 0)
    assert size.optimizer == wrote["optim"] and size.optimizer > 0
    assert size.router_bias == sum(v for k, v in wrote.items() if k.startswith("balancing/"))
    assert (size.router_bias > 0) == ("bias_update_rate" in str(CASES[name]))
