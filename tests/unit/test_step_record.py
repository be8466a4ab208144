"""The step record read back from metrics.jsonl (StepMetrics.from_json): the inverse of to_json for today's line,
and a stated meaning for each field an older or partial line lacks."""

from __future__ import annotations

import json
import math

import pytest

from asyncpp.core.records import PipelineBubble, StepMetrics
from asyncpp.train.metrics import _jsonable


def full_record(**changes) -> StepMetrics:
    fields = {"step": 7, "loss": 3.25, "lr": 0.01, "grad_norm": 1.5, "update_norm": 0.02, "tokens_per_s": 1234.5,
              "step_time_s": 0.75, "skipped": False, "sync_step": True, "global_batch_size": 16,
              "consumed_tokens": 4096, "update_cosine": 0.9, "update_rel_error": 0.1,
              "moe": {"moe/load_max": 1.25, "moe/aux_loss": 1.01}, "val_loss": 3.5,
              "bubble": PipelineBubble(0.125, (0.1, 0.15))}
    return StepMetrics(**{**fields, **changes})


@pytest.mark.parametrize("record", [full_record(), full_record(update_cosine=None, update_rel_error=None, moe={},
                                                               val_loss=None, bubble=None)], ids=["all", "bare"])
def test_a_line_of_today_reads_back_as_the_record_written(record):
    line = json.loads(json.dumps({k: _jsonable(v) for k, v in record.to_json().items()}))  # the writer's path
    assert StepMetrics.from_json(line) == record
    assert StepMetrics.from_json(line).to_json() == record.to_json()


def test_non_finite_values_written_as_strings_read_back_as_floats():
    record = full_record(loss=math.nan, grad_norm=math.inf, skipped=True, val_loss=math.nan)
    line = json.loads(json.dumps({k: _jsonable(v) for k, v in record.to_json().items()}))
    assert line["loss"] == "nan" and line["grad_norm"] == "inf"
    back = StepMetrics.from_json(line)
    assert math.isnan(back.loss) and back.grad_norm == math.inf and math.isnan(back.val_loss) and back.skipped


def test_an_older_or_partial_line_means_what_from_json_states():
    before_rampup = {k: v for k, v in full_record().to_json().items()
                     if k not in ("global_batch_size", "consumed_tokens")}
    old = StepMetrics.from_json(before_rampup)
    assert old.global_batch_size is None and old.consumed_tokens is None and old.loss == 3.25
    partial = StepMetrics.from_json({"step": 3, "loss": 4.0})  # tools/report.py's test fixtures write such lines
    assert partial.step == 3 and partial.loss == 4.0 and not partial.skipped and not partial.sync_step
    assert all(math.isnan(getattr(partial, k)) for k in ("lr", "grad_norm", "update_norm", "step_time_s"))
    assert partial.val_loss is None and partial.moe == {} and partial.bubble is None
    with pytest.raises(ValueError, match="without 'step'"):
        StepMetrics.from_json({"loss": 4.0})
