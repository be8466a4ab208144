"""parallel.head=vocab in checkpoints: each stage's head rows are saved by their global offsets under the layout-free
key of the whole head (lm_head.weight, or embed.weight when tied, whose rows on the later stages the first stage
saves whole), so a run resumes exactly on its own layout and continues on another P or with the head on the last
stage (semantics.md "What must hold" 5)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.test_pipeline_equivalence import relative_error
from tests.dist.tp_workers import ADAMW_EPS
from tests.dist.workers import make_config, pipeline_rank

pytestmark = [pytest.mark.equivalence, pytest.mark.dist]

UNTIED = {"name": "tiny_dense", "overrides": {"tie_embeddings": False}}


def pipeline(cfg) -> tuple[dict[int, dict], dict[tuple[int, str], torch.Tensor]]:
    """The run's records by step and every stage's parameters by (stage, name): each stage holds other rows of the
    head under the one name."""
    results = run_ranks(pipeline_rank, cfg.parallel.pp * cfg.parallel.tp, cfg.to_dict())
    records = {r["step"]: r for res in results for r in res["records"]}
    return records, {(res["stage"], res["tp"], n): p for res in results for n, p in res["params"].items()}


def config(root, pp: int, head: str = "vocab", resume: str | None = None, tp: int = 1, embedding: str = "first",
           **extra):
    checkpoint = {"enabled": True, "every": 3, "dir": str(root / "ckpt")} if resume is None else {
        "enabled": False, "resume": resume}
    # AdamW at the TP tests' eps: a run continued on another layout differs by reduction order, which AdamW at
    # eps = 1e-8 amplifies without bound on entries whose gradient is near zero (test_vocab_parallel_pipeline.py's
    # docstring derives it).
    return make_config(parallel={"pp": pp, "tp": tp, "sequence_parallel": tp > 1, "head": head, "stage_layers": None,
                                 "embedding": embedding},
                       staleness={"ef_lambda": 1.0},
                       checkpoint=checkpoint, optimizer={"eps": ADAMW_EPS}, **extra)


@pytest.mark.parametrize("model", [UNTIED, pytest.param({"name": "tiny_dense"}, marks=pytest.mark.slow)],
                         ids=["untied", "tied"])
def test_vocab_head_resume_is_bitwise_exact(tmp_path, model):
    full, full_params = pipeline(config(tmp_path, 2, model=model))
    resumed, params = pipeline(config(tmp_path / "b", 2, model=model,
                                      resume=str(tmp_path / "ckpt" / "step_00000003")))
    assert sorted(resumed) == [3, 4, 5]
    for t in (3, 4, 5):
        assert resumed[t]["loss"] == full[t]["loss"] and resumed[t]["grad_norm"] == full[t]["grad_norm"], t
    assert sum(p.shape[0] for (*_, n), p in full_params.items() if n == "lm_head.weight") < 2 * 8192  # rows, spread
    for key, p in full_params.items():
        assert torch.equal(params[key], p), key


@pytest.mark.slow
@pytest.mark.parametrize("model", [UNTIED, {"name": "tiny_dense"}], ids=["untied", "tied"])
def test_vocab_head_checkpoint_continues_on_four_stages_and_with_the_head_on_the_last(tmp_path, model):
    """Saved at P=2 with the head over both stages: resumed at P=4 (other rows on every stage) it continues like
    the run that was at P=4 all along; resumed at P=2 with the head on the last stage, like that run."""
    pipeline(config(tmp_path / "a", 2, model=model))
    saved = str(tmp_path / "a" / "ckpt" / "step_00000003")
    for pp, head in ((4, "vocab"), (2, "last")):
        want, want_params = pipeline(config(tmp_path / f"w{pp}{head}", pp, head, model=model))
        got, params = pipeline(config(tmp_path / f"r{pp}{head}", pp, head, model=model, resume=saved))
        assert sorted(got) == [3, 4, 5]
        for t in (3, 4, 5):
            assert got[t]["loss"] == pytest.approx(want[t]["loss"], rel=1e-5), (pp, head, t)
        for key, p in want_params.items():
            assert params[key].shape == p.shape and relative_error(params[key], p) < 1e-5, (pp, head, key)


@pytest.mark.slow
def test_vocab_head_checkpoint_of_tensor_parallel_pieces_continues_without_tp(tmp_path):
    """Saved at P=2 x TP=2 with SP (four pieces of the head, by offset), resumed at P=4 x TP=1 (four other rows)."""
    pipeline(config(tmp_path / "a", 2, tp=2, model=UNTIED))
    want, want_params = pipeline(config(tmp_path / "w", 4, model=UNTIED))
    got, params = pipeline(config(tmp_path / "r", 4, model=UNTIED, resume=str(tmp_path / "a" / "ckpt" / "step_00000003")))
    assert sorted(got) == [3, 4, 5]
    for t in (3, 4, 5):
        assert got[t]["loss"] == pytest.approx(want[t]["loss"], rel=1e-5), t
    for key, p in want_params.items():
        assert params[key].shape == p.shape and relative_error(params[key], p) < 1e-5, key


@pytest.mark.slow
@pytest.mark.parametrize("model", [UNTIED, {"name": "tiny_dense"}], ids=["untied", "tied"])
def test_sharded_embedding_resumes_exactly_and_continues_on_four_stages_and_whole(tmp_path, model):
    """parallel.embedding=vocab: each stage's embedding rows are saved by their offsets under embed.weight. Resumed on
    its own layout the run is bitwise the same; saved at P=2 it continues at P=4 (other rows) and at P=2 with the
    embedding whole on the first stage, like the runs that were there all along."""
    full, full_params = pipeline(config(tmp_path / "a", 2, embedding="vocab", model=model))
    assert all(p.shape[0] < 8192 for (*_, n), p in full_params.items() if n == "embed.weight")  # rows, spread
    saved = str(tmp_path / "a" / "ckpt" / "step_00000003")
    resumed, params = pipeline(config(tmp_path / "b", 2, embedding="vocab", model=model, resume=saved))
    for t in (3, 4, 5):
        assert resumed[t]["loss"] == full[t]["loss"] and resumed[t]["grad_norm"] == full[t]["grad_norm"], t
    for key, p in full_params.items():
        assert torch.equal(params[key], p), key
    for pp, embedding in ((4, "vocab"), (2, "first")):
        want, want_params = pipeline(config(tmp_path / f"w{pp}{embedding}", pp, embedding=embedding, model=model))
        got, params = pipeline(config(tmp_path / f"r{pp}{embedding}", pp, embedding=embedding, model=model,
                                      resume=saved))
        assert sorted(got) == [3, 4, 5]
        for t in (3, 4, 5):
            assert got[t]["loss"] == pytest.approx(want[t]["loss"], rel=1e-5), (pp, embedding, t)
        for key, p in want_params.items():
            assert params[key].shape == p.shape and relative_error(params[key], p) < 1e-5, (pp, embedding, key)
