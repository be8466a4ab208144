"""The Megatron example checkpoints and resumes: a run stopped at iteration 3 (--save --exit-interval 3) and resumed
(--load) equals the uninterrupted run bit for bit, on 2 ranks (PP=2) with Error Feedback on.

Bit for bit, not to a tolerance: the resumed run executes the same kernels on the same tensors in the same order
as the uninterrupted one. Both drain at iteration 3 (the uninterrupted one for its evaluation, --eval-interval 3),
so both start a 2BW stream at b_3 reading x_2 with x_3 newest; the resumed run gets x_3, x_2, EF's u_2 and the
optimizer state from the checkpoint by value, its data iterator starts at b_3's microbatches, and its RNG state is
the saved one. Any state missing from the checkpoint (a weight version, the EF buffer, Muon's momentum) would
change the losses of iterations 4-6 and the final weights.

Each run is its own pair of processes (run_ranks), as a restart is. About 10-20 s on this 2-core box.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from asyncpp.pipeline.update import StepRecord
from examples.megatron_2bw import LogLines, parse_args
from tests.dist.harness import run_ranks
from tests.dist.megatron_checkpoint_workers import example_rank, unsplit_rank
from tests.dist.test_pipeline_equivalence import relative_error

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

ARGS = ["--train-iters", "6", "--eval-interval", "3", "--ef-lambda", "1", "--num-layers", "2"]


SPREAD = ["--vocab-parallel-head"]
LAYOUTS = {"pp2": [], "pp2_tp2": ["--tp", "2"],
           "pp2_vocab": [*SPREAD, "--untie-embeddings-and-output-weights"], "pp2_vocab_tied": SPREAD,
           "pp2_vocab_embedding_tied": [*SPREAD, "--vocab-parallel-embedding"],
           "pp2_tp2_sp_vocab": ["--tp", "2", "--sequence-parallel", *SPREAD, "--untie-embeddings-and-output-weights"]}


def run(layout: str, *argv: str) -> list[dict]:
    """Every rank's log (megatron's rank order is tp fastest: the last stage's first rank is rank tp)."""
    tp = 2 if "--tp" in LAYOUTS[layout] else 1
    return run_ranks(example_rank, 2 * tp, [*ARGS, *LAYOUTS[layout], *map(str, argv)], timeout=600.0)


def tensors(path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's every tensor, by key (whole tensors: DCP's own conversion)."""
    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def stopped_and_resumed(tmp_path, layout: str):
    """The uninterrupted run, the run stopped at 3 and the resumed one, each its own processes; checks that the
    resumed one equals the uninterrupted one bit for bit (losses, validation loss, grad norms, every tensor of the
    final checkpoint) and that this is not vacuous. Returns every rank's log of the uninterrupted run, its final
    checkpoint's tensors and the tensors at the stop."""
    tp = 2 if "--tp" in LAYOUTS[layout] else 1
    logs = run(layout, "--save", tmp_path / "whole")
    whole = logs[tp]
    first = run(layout, "--save", tmp_path / "a", "--exit-interval", "3")[tp]
    saved = tmp_path / "a" / "step_00000003"
    # the mechanism ran: the stop wrote a committed checkpoint of iteration 3 and stopped there
    assert first["saved"] == [str(saved)] and len(first["train"]) == 3
    assert json.loads((saved / "manifest.json").read_text())["step"] == 3 and (saved / ".metadata").is_file()
    resumed = run(layout, "--load", tmp_path / "a", "--save", tmp_path / "b")[tp]
    assert resumed["start_iteration"] == 3 and len(resumed["train"]) == 3

    assert first["train"] == whole["train"][:3]
    assert resumed["train"] == whole["train"][3:]  # losses of iterations 4-6, bit for bit
    assert resumed["valid"] == {6: whole["valid"][6]}
    assert resumed["grad_norm"] == {k: whole["grad_norm"][k] for k in (4, 5, 6)}

    end, end_resumed, at_stop = (tensors(p) for p in (tmp_path / "whole" / "step_00000006",
                                                        tmp_path / "b" / "step_00000006", saved))
    assert set(end) == set(end_resumed) == set(at_stop)
    kinds = {k.split("/")[0] for k in end}
    assert kinds == {"weights", "ef", "optim"}, kinds
    assert {k.split("/")[1] for k in end if k.startswith("weights/")} == {"0", "1"}  # x_t and x_{t-1}
    # the unsplit model's names and shapes whatever the layout: layer 1 lives on stage 1 (its local layer 0), and a
    # TP-sharded matrix is whole (megatron's fc1: [ffn = 4 x hidden, hidden], split over TP along dim 0)
    assert end["weights/0/decoder.layers.1.mlp.linear_fc1.weight"].shape == (4 * 64, 64)
    different = [k for k in end if not torch.equal(end[k], end_resumed[k])]
    assert not different, different[:5]  # every weight of both versions, u_5 and the optimizer state
    # ... and not vacuously: the state moved after the resume, and EF's buffer held something to restore
    newest = [k for k in end if k.startswith("weights/0/")]
    assert len(newest) > 10 and all(not torch.equal(end[k], at_stop[k]) for k in newest)
    assert any(at_stop[k].abs().sum() > 0 for k in at_stop if k.startswith("ef/"))
    return logs, end, at_stop


@pytest.mark.parametrize("layout", [pytest.param("pp2"),
                                    pytest.param("pp2_tp2", marks=pytest.mark.slow)])  # TP shards as DTensors; ~2 min
def test_stopped_and_resumed_equals_uninterrupted(tmp_path, layout):
    stopped_and_resumed(tmp_path, layout)


def test_log_lines_print_each_iteration_with_its_own_grad_norm(capsys):
    """Under 2BW iteration k's update is applied two calls later: its line waits for it, so the grad norm printed
    beside iteration k's loss is step k-1's (0-based), not the newest applied one's."""
    class Pipeline:
        applied_step, records = None, {}

    args = parse_args(["--train-iters", "4"])
    pipe = Pipeline()
    lines = LogLines(args, pipe, dp=1, printing=True)
    for k, applied in zip(range(1, 5), (None, None, 0, 1)):  # 2BW: call k applies step k-3 (0-based)
        pipe.applied_step = applied
        if applied is not None:
            pipe.records[applied] = StepRecord(applied, grad_norm=10.0 + applied, lr=0.01)
        lines.add(k, 0.1, 5.0 - k)
        lines.flush()
    assert lines.grad_norms == {1: 10.0, 2: 11.0}
    for t in (2, 3):  # the drain applies the rest
        pipe.records[t] = StepRecord(t, grad_norm=10.0 + t, lr=0.01)
    pipe.applied_step = 3
    lines.flush()
    printed = [line for line in capsys.readouterr().out.splitlines() if "] iteration " in line]
    assert [int(line.split("iteration")[1].split("/")[0]) for line in printed] == [1, 2, 3, 4]
    assert [float(line.split("grad norm: ")[1].split(" ")[0]) for line in printed] == [10.0, 11.0, 12.0, 13.0]
    assert all(math.isfinite(v) for v in lines.grad_norms.values()) and list(pipe.records) == [3]


def test_load_without_a_checkpoint_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for given, says in ((tmp_path / "empty", "holds no complete checkpoint"), (tmp_path / "nope", "not a directory")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--load", str(given)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--load={given}" in err and says in err
    with pytest.raises(SystemExit):
        parse_args(["--save-interval", "2"])
    assert "--save-interval=2 needs --save DIR" in capsys.readouterr().err


HEAD, EMBEDDING, VOCAB = "output_layer.weight", "embedding.word_embeddings.weight", 128  # the example's --vocab-size


@pytest.mark.parametrize("layout", [pytest.param("pp2_vocab"),  # ~40 s
                                    pytest.param("pp2_vocab_tied", marks=pytest.mark.slow),
                                    pytest.param("pp2_vocab_embedding_tied", marks=pytest.mark.slow),
                                    pytest.param("pp2_tp2_sp_vocab", marks=pytest.mark.slow)])  # ~30 s
def test_spread_head_stopped_and_resumed_equals_uninterrupted(tmp_path, layout):
    """--vocab-parallel-head: every stage's rows of the head (and of a sharded embedding), their optimizer state
    and EF buffer are in the checkpoint, so the resumed run equals the uninterrupted one bit for bit
    (stopped_and_resumed). Each stage's rows are saved at their offset in the whole weight under megatron's name
    (DCP's chunks of it are the stages' rows; a tied table kept whole on the first stage is one chunk, the other
    stage's copy of its rows is loaded from it), and the checkpoint loads strictly into megatron's unsplit GPTModel,
    whose loss on the validation microbatches is the run's."""
    logs, end, at_stop = stopped_and_resumed(tmp_path, layout)
    # every (stage, TP rank)'s rows, in rank order (megatron's: TP fastest), consecutive over the vocabulary
    rows = [(log["vocab_start"], log["vocab_rows"][0]) for log in logs]
    assert [start for start, _ in rows] == [sum(n for _, n in rows[:i]) for i in range(len(rows))], rows
    assert sum(n for _, n in rows) == VOCAB and min(n for _, n in rows) > 0
    path = tmp_path / "whole" / "step_00000006"
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tied = "--untie-embeddings-and-output-weights" not in LAYOUTS[layout]
    sharded = "--vocab-parallel-embedding" in LAYOUTS[layout]
    tp = 2 if "--tp" in LAYOUTS[layout] else 1  # a whole table: megatron's TP pieces of it (DTensor shards)
    table = [(t * VOCAB // tp, VOCAB // tp) for t in range(tp)]
    expected = {EMBEDDING: rows if sharded else table, **({} if tied else {HEAD: rows})}
    assert tied == (f"weights/0/{HEAD}" not in meta)  # a tied head is the embedding
    for name, pieces in expected.items():
        for key in (f"weights/0/{name}", f"weights/1/{name}", f"ef/{name}"):
            assert sorted((c.offsets[0], c.sizes[0]) for c in meta[key].chunks) == pieces, key
            assert meta[key].size == (VOCAB, 64), key
        for start, n in rows:  # every stage's rows moved after the resume
            now, then = (t[f"weights/0/{name}"][start:start + n] for t in (end, at_stop))
            assert not torch.equal(now, then), (name, start)

    unsplit_args = [*ARGS, "--pp", "1", *(["--untie-embeddings-and-output-weights"] if not tied else [])]
    unsplit = run_ranks(unsplit_rank, 1, unsplit_args, str(path), timeout=300.0)[0]
    assert unsplit["missing"] == unsplit["unexpected"] == []
    assert unsplit["keys"] == sorted(k[len("weights/0/"):] for k in end if k.startswith("weights/0/"))
    # the unsplit model's loss (megatron's output layer and cross entropy over the whole vocabulary) against the
    # spread head's (each stage's logits of its rows, their softmax statistics merged): the same fp32 values
    # reduced in another order, a few ulp of the loss (test_megatron_core's RTOL and its derivation)
    # (under SP the run's norms are megatron_cpu's SequenceParallelLayerNorm, the unsplit model's torch's: the same
    # normalisation in another float order, as test_megatron_core's SP case compares them at the same bound)
    assert unsplit["loss"] == pytest.approx(logs[tp]["valid"][6], rel=1e-5, abs=0)  # the last stage's first rank


@pytest.mark.slow  # three runs of 2, 2 and 4 processes: about 30 s on this box
def test_spread_head_checkpoint_resumes_at_another_tp_degree(tmp_path):
    """A spread-head checkpoint saved at PP=2 resumes at PP=2 x TP=2: DCP reads each (stage, TP rank)'s rows, split by
    the cost model for TP 2 (its shards multiples of 2), and megatron's TP pieces by their offsets in the whole
    weights. Not bit for bit: under TP the row-parallel matmuls sum two halves and Muon orthogonalises the gathered
    matrices, another float order (test_megatron_core's RTOL and its derivation), so the resumed iterations' losses
    and the final weights equal the uninterrupted PP=2 run's at that bound, and the state really moved."""
    argv = [*ARGS, *LAYOUTS["pp2_vocab"]]
    whole = run_ranks(example_rank, 2, [*argv, "--save", str(tmp_path / "whole")], timeout=600.0)
    run_ranks(example_rank, 2, [*argv, "--save", str(tmp_path / "a"), "--exit-interval", "3"], timeout=600.0)
    resumed = run_ranks(example_rank, 4, [*argv, "--tp", "2", "--load", str(tmp_path / "a"),
                                          "--save", str(tmp_path / "b")], timeout=600.0)
    assert resumed[2]["start_iteration"] == 3 and len(resumed[2]["train"]) == 3
    # every (stage, TP rank) took its own rows: a stage's two TP ranks equal pieces, all four covering the vocabulary
    assert resumed[0]["vocab_rows"] == resumed[1]["vocab_rows"] and sum(r["vocab_rows"][0] for r in resumed) == VOCAB
    assert resumed[2]["train"] == pytest.approx(whole[1]["train"][3:], rel=1e-5)
    end, end_tp, at_stop = (tensors(p) for p in (tmp_path / "whole" / "step_00000006", tmp_path / "b" / "step_00000006",
                                                  tmp_path / "a" / "step_00000003"))
    newest = [k for k in end if k.startswith("weights/0/")]
    assert set(newest) == {k for k in end_tp if k.startswith("weights/0/")}
    worst = max((relative_error(end_tp[k], end[k]), k) for k in newest)
    print(f"resumed at TP 2: worst weight relative error {worst[0]:.2e} ({worst[1]})")  # pytest -s: the margin
    assert worst[0] < 1e-5, worst
    assert all(not torch.equal(end_tp[k], at_stop[k]) for k in newest)
