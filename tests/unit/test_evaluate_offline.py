"""`--tasks paper` without network: the failure to reach the hub becomes an error that names the datasets to
pre-download and how, instead of a raw ConnectionError traceback."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval")

from lm_eval.tasks._index import Kind

from tools import evaluate


def _index(tmp_path: Path) -> dict:
    """A small lm-eval task index: a group over a tag and a task, a task whose dataset is in its template."""
    (tmp_path / "_template.yaml").write_text("dataset_path: cais/mmlu\nprocess_docs: !function utils.process\n")
    entry = lambda name, kind, cfg, tags=(), path=None: SimpleNamespace(
        name=name, kind=kind, cfg=cfg, tags=set(tags), yaml_path=path)
    return {
        "mmlu": entry("mmlu", Kind.GROUP, {"task": ["mmlu_stem", {"task": "mmlu_law"}]}),
        "mmlu_stem": entry("mmlu_stem", Kind.TAG, {}),
        "mmlu_anatomy": entry("mmlu_anatomy", Kind.TASK, {"dataset_path": "cais/mmlu", "dataset_name": "anatomy"},
                              tags=["mmlu_stem"]),
        "mmlu_law": entry("mmlu_law", Kind.TASK, {"include": "_template.yaml", "dataset_name": "law"},
                          path=tmp_path / "mmlu_law.yaml"),
        "piqa": entry("piqa", Kind.TASK, {"dataset_path": "baber/piqa", "dataset_name": None}),
    }


def test_hub_datasets_follow_groups_tags_and_templates(tmp_path):
    found = evaluate.hub_datasets(_index(tmp_path), ["mmlu", "piqa", "not_a_task"])
    assert found == {"cais/mmlu": {"anatomy", "law"}, "baber/piqa": {""}}


def test_offline_cause_is_found_along_the_chain():
    try:
        try:
            raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub (LocalEntryNotFoundError)")
        except ConnectionError as inner:
            raise RuntimeError("task piqa failed to build") from inner
    except RuntimeError as outer:
        assert isinstance(evaluate.offline_cause(outer), ConnectionError)
    assert evaluate.offline_cause(RuntimeError("a bug")) is None


def test_paper_tasks_offline_name_the_datasets_and_how_to_get_them(tmp_path, monkeypatch):
    """evaluate() with lm-eval's hub access failing as it does here (datasets raises ConnectionError)."""
    import lm_eval
    import lm_eval.tasks

    index = _index(tmp_path)

    def unreachable(**kwargs):
        raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", unreachable)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_defaults: SimpleNamespace(task_index=index))
    monkeypatch.setattr(evaluate, "task_specs", lambda names: ["mmlu", "piqa"])
    with pytest.raises(evaluate.EvaluateError) as err:
        evaluate.evaluate(lm=None, tasks=["paper"])
    message = str(err.value)
    assert "tasks mmlu, piqa read their data from the Hugging Face hub, which this machine cannot reach" in message
    assert "ConnectionError: Couldn't reach 'baber/piqa'" in message
    assert "baber/piqa (default); cais/mmlu (anatomy, law)" in message
    assert "huggingface-cli download --repo-type dataset cais/mmlu" in message
    assert "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1" in message and "HF_HOME" in message


def test_other_failures_are_not_translated(monkeypatch, tmp_path):
    import lm_eval
    import lm_eval.tasks

    def broken(**kwargs):
        raise KeyError("a bug in a task")

    monkeypatch.setattr(lm_eval, "simple_evaluate", broken)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_defaults: SimpleNamespace(task_index={}))
    monkeypatch.setattr(evaluate, "task_specs", lambda names: ["piqa"])
    with pytest.raises(KeyError, match="a bug in a task"):
        evaluate.evaluate(lm=None, tasks=["paper"])


@pytest.mark.slow
def test_real_paper_task_offline_on_a_trained_checkpoint(tmp_path, monkeypatch, capsys):
    """The real thing: lm-eval's own task index and datasets' offline failure, through the CLI (exit 2)."""
    from asyncpp import job

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    cfg, model_cfg = job.resolve(job.compose([
        f"out_dir={run}", "model=tiny_dense", "logging=disabled", "logging.progress=false", "train.steps=1",
        "train.eval_every=0", "train.micro_batch_size=1", "train.num_microbatches=1", "train.seq_len=16",
        "optimizer.schedule.warmup_steps=1"]))
    job.run(cfg, model_cfg)
    assert evaluate.main(["--checkpoint", str(run), "--tasks", "piqa,arc_easy", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "evaluate error: tasks piqa, arc_easy read their data from the Hugging Face hub" in err
    assert "allenai/ai2_arc (ARC-Easy); baber/piqa (default)" in err
    assert "Traceback" not in err
