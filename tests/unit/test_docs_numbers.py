"""The docs' computed numbers (tools/docs_numbers.py, issue 47): a number between markers that differs from the
generated one fails, naming the document, the line, the name, what it reads and what the code computes; the docs as
committed hold the generated numbers (the cheap ones recomputed here, the slow ones from docs/numbers.json, which the
slow test recomputes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import docs_numbers as dn


def test_a_wrong_number_is_reported_and_a_rewrite_fixes_it(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\nsmollm2_135m has <!-- n:params.smollm2_135m -->999.9M<!-- /n --> parameters, "
                   "<!-- n:no_such -->1<!-- /n -->\n")
    values = {"params.smollm2_135m": "134.5M"}
    assert dn.differences([doc], values) == [
        "doc.md:2: params.smollm2_135m reads '999.9M', the code computes '134.5M'; run python -m tools.docs_numbers",
        "doc.md:2: no_such is computed by nothing in tools/docs_numbers.py"]
    assert dn.rewrite([doc], values) == [doc]
    assert "<!-- n:params.smollm2_135m -->134.5M<!-- /n --> parameters" in doc.read_text()
    assert dn.differences([doc], values) == ["doc.md:2: no_such is computed by nothing in tools/docs_numbers.py"]


def test_the_docs_hold_the_generated_numbers():
    cache = json.loads(dn.CACHE.read_text())
    values = dn.compute(slow=False, cache=cache)  # parameter counts on the meta device; the dry runs from the cache
    assert values["params.moe_2b"].startswith("1.9") and values["params.tiny_dense"] == "1.8M"  # they really ran
    assert dn.differences(dn.documents(), values) == []
    used = {m["name"] for path in dn.documents() for m in dn.MARKER.finditer(path.read_text())}
    assert used == set(dn.numbers()), "every generated number is quoted, every quoted one generated"
    assert set(cache) == {name for name, n in dn.numbers().items() if n.slow}


@pytest.mark.slow
def test_the_cached_slow_numbers_are_what_the_code_computes_today():
    """The recipes' dry runs and the default suite's collection (minutes on a loaded 2-core machine)."""
    cache = json.loads(dn.CACHE.read_text())
    assert dn.compute(slow=True, cache={}) == dn.compute(slow=False, cache=cache)


def test_gpu_hours_are_the_token_budget_over_one_gpus_rate_and_the_wall_time_that_over_the_gpus(monkeypatch):
    """A job of 8 GPUs at 1,000 tokens/s per GPU, 16,000 tokens per step (every replica's): 95,400 steps are
    95,400 x 16,000 / 1,000 / 3,600 = 424.0 GPU-hours, 53.0 h on the 8 GPUs (the first version gave the 53.0 as
    GPU-hours). The trace is faked; the recipe's steps, world size and trace options are the real config's."""
    seen = {}

    def fake_run_dry(cfg, model_cfg, echo):
        seen.update(trace=cfg.dry_run_trace, microbatches=cfg.dry_run_trace_microbatches, pp=cfg.parallel.pp,
                    steps=cfg.train.steps)
        run = {"tokens_per_step": 16_000, "tokens_per_s_per_gpu": 1_000.0, "mfu": 0.25}
        out = {"prediction": {"devices": {"H100": {"job": run}, "H200": {"job": {**run, "tokens_per_s_per_gpu": 2_000.0}}}}}
        (Path(cfg.out_dir) / "dry_run_trace.json").parent.mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "dry_run_trace.json").write_text(json.dumps(out))
        return []

    monkeypatch.setattr(dn.job, "run_dry", fake_run_dry)
    text = dn.recipe_gpu_hours("moe_2b")
    assert seen == {"trace": True, "microbatches": seen["pp"], "pp": 2, "steps": 95_400}  # P microbatches traced
    assert text == ("H100 424.0, 53.0 h on 8 GPUs (1,000 tokens/s per GPU, MFU 25.0%); "
                    "H200 212.0, 26.5 h on 8 GPUs (2,000 tokens/s per GPU, MFU 25.0%)")
