"""tools.evaluate: the lm-eval adapter scores exactly what the model's logits say, and the CLI runs the
offline task on a real (tiny) checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")

from data.default import DEFAULT_TOKENIZER
from data.tokenizer import load_tokenizer
from tools.evaluate import AsyncppLM, main, task_specs


@pytest.fixture(scope="module")
def lm() -> AsyncppLM:
    from model_zoo import build_model, get_model_config

    torch.manual_seed(0)
    model = build_model(get_model_config("tiny_dense"))
    tok = load_tokenizer(DEFAULT_TOKENIZER)
    return AsyncppLM(model, tok.tokenizer, tok.eod_id, max_length=512, batch_size=3)


def direct_logprob(lm: AsyncppLM, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) from one unbatched forward, written out token by token."""
    enc = lambda s: lm.tokenizer.encode(s, add_special_tokens=False).ids
    whole, ctx = enc(context + continuation), enc(context)
    cont = whole[len(ctx):]
    tokens = (ctx or [lm.eod_id]) + cont
    with torch.no_grad():
        logits = lm.model(torch.tensor([tokens[:-1]]))[0].double()
    total, greedy = 0.0, True
    for j, token in enumerate(cont):
        pos = len(tokens) - 1 - len(cont) + j  # the position whose output predicts cont[j]
        total += (logits[pos] - torch.logsumexp(logits[pos], dim=-1))[token].item()
        greedy &= int(logits[pos].argmax()) == token
    return total, greedy


def test_loglikelihood_equals_the_models_logits(lm):
    requests = [("The built-in function", " len"), ("A dictionary maps keys to ", "values"),  # trailing space
                ("", "import os"), ("Lists support slicing: all slice operations return a new", " list object"),
                ("x", " = 1")]
    got = lm.loglikelihood([SimpleNamespace(args=r) for r in requests])  # 5 requests, batches of 3 (padding)
    for (ctx, cont), (lp, greedy) in zip(requests, got):
        ref_lp, ref_greedy = direct_logprob(lm, ctx.rstrip(), ctx[len(ctx.rstrip()):] + cont)
        assert lp == pytest.approx(ref_lp, abs=1e-4)
        assert greedy == ref_greedy
    assert all(lp < 0 for lp, _ in got)


def test_rolling_loglikelihood_is_the_whole_text_after_eod(lm):
    text = "The for statement iterates over the items of any sequence."
    (rolled,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert rolled == pytest.approx(direct_logprob(lm, "", text)[0], abs=1e-4)
    # a context window shorter than the text: every token is still scored exactly once
    short = AsyncppLM(lm.model, lm.tokenizer, lm.eod_id, max_length=4, batch_size=2)
    (chunked,) = short.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert chunked < 0 and chunked != pytest.approx(rolled, abs=1e-4)  # less context, different (finite) score


def test_generation_is_refused_with_a_way_out(lm):
    with pytest.raises(NotImplementedError, match="tools.hf export"):
        lm.generate_until([SimpleNamespace(args=("def f():", {"until": ["\n"]}))])


def test_task_lists_expand():
    local = task_specs(["local"])
    assert [s["task"] for s in local] == ["asyncpp_pydoc_cloze", "asyncpp_pydoc_text"]
    assert all(s["dataset_kwargs"]["data_files"]["test"].startswith("/") for s in local)
    paper = task_specs(["paper"])
    assert {"mmlu", "hellaswag", "piqa", "boolq", "winogrande", "arc_easy", "arc_challenge"} <= set(paper)


def test_cli_on_a_trained_checkpoint(tmp_path, monkeypatch):
    """Train 2 steps, then `python -m tools.evaluate --checkpoint <run>` on the offline cloze task; its
    accuracy must be what the adapter's own log-likelihoods imply."""
    from asyncpp import job
    from tools.evaluate import load_lm

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run = tmp_path / "run"
    cfg, model_cfg = job.resolve(job.compose([
        f"out_dir={run}", "model=tiny_dense", "logging=disabled", "logging.progress=false", "train.steps=2",
        "train.eval_every=0", "train.micro_batch_size=2", "train.num_microbatches=2", "train.seq_len=32",
        "optimizer.schedule.warmup_steps=1"]))
    job.run(cfg, model_cfg)
    out = tmp_path / "results.json"
    assert main(["--checkpoint", str(run), "--tasks", "asyncpp_pydoc_cloze", "--limit", "8", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["checkpoint"].endswith("step_00000002")
    acc = results["results"]["asyncpp_pydoc_cloze"]["acc,none"]

    lm = load_lm(run)
    path = task_specs(["asyncpp_pydoc_cloze"])[0]["dataset_kwargs"]["data_files"]["test"]
    docs = [json.loads(line) for line in Path(path).read_text().splitlines()][:8]  # --limit 8: the first 8
    right = 0
    for doc in docs:
        scores = lm.loglikelihood([SimpleNamespace(args=(doc["context"], " " + c)) for c in doc["choices"]])
        right += max(range(len(scores)), key=lambda i: (scores[i][0], -i)) == doc["answer"]
    assert acc == pytest.approx(right / len(docs))
