"""The console and pretrain.log (issue 20): a Megatron-style line every logging.log_every iterations, to stdout
and to <out_dir>/pretrain.log; a progress bar only on a terminal; TFLOP/s and MFU from the model's FLOP count."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest

from asyncpp.config import RunConfig
from asyncpp.core.records import StepMetrics
from asyncpp.train.metrics import LOG_FILE, MetricsLogger, summary_table
from asyncpp.train.throughput import PEAK_TFLOPS, Throughput, device_peak_tflops, peak_memory_bytes
from asyncpp.train.trainer import Trainer
from model_zoo import flops_per_token, get_model_config
from tests.unit.test_trainer import Scripted


def record(step: int, loss: float, seconds: float = 0.5, tokens: int = 1000, **extra) -> StepMetrics:
    fields = {"step": step, "loss": loss, "lr": 1e-3 * (step + 1), "grad_norm": 2.0 + step, "update_norm": 0.1,
              "tokens_per_s": tokens / seconds, "step_time_s": seconds, "skipped": False, "sync_step": False,
              "global_batch_size": tokens // 10, "consumed_tokens": (step + 1) * tokens}
    return StepMetrics(**{**fields, **extra})


def logger(tmp_path, **kw) -> MetricsLogger:
    return MetricsLogger(tmp_path, total_steps=kw.pop("total_steps", 6), progress=kw.pop("progress", True),
                         log_every=kw.pop("log_every", 3), **kw)


def test_a_line_every_log_every_iterations_to_stdout_and_pretrain_log(tmp_path, capsys):
    m = logger(tmp_path, throughput=Throughput(flops_per_token=4e9, devices=2, peak_tflops=8.0))
    for t in range(6):
        m.log(record(t, loss=10.0 - t, seconds=0.5 if t < 3 else 0.25, skipped=(t == 4)))
    m.message("a message")
    m.close({"final_loss": 5.0})
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "iteration" in line]
    assert len(lines) == 2, out  # iterations 3 and 6
    first, second = lines
    # Window means: loss (10+9+8)/3, 500 ms/iter, 2000 tokens/s; lr and grad norm of the window's last step.
    for fragment in ("iteration 3/6", "consumed tokens 3,000", "global batch 100", "500.0 ms/iter", "2,000 tokens/s", "lr 3.000e-03",
                     "loss 9.0000", "grad norm 4.000", "skipped 0", "bubble n/a (one process", "MiB",
                     "4 TFLOP/s/device", "MFU 50.0%"):  # 4e9 FLOPs x 2000 tokens/s / 2 devices = 4 TFLOP/s of 8
        assert fragment in first, (fragment, first)
    for fragment in ("iteration 6/6", "consumed tokens 6,000", "250.0 ms/iter", "loss 6.0000", "skipped 1",
                     "MFU 100.0%"):
        assert fragment in second, (fragment, second)
    text = (tmp_path / LOG_FILE).read_text()
    assert first.split("] ", 1)[1] in text and second.split("] ", 1)[1] in text
    assert "a message" in text and f"summary ({tmp_path / 'summary.json'}):" in text
    assert re.search(r"\n  final loss\s+5\.0000\n", text)
    assert re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ", text)  # timestamped


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path, capsys):
    assert not sys.stderr.isatty()  # pytest captures it
    m = logger(tmp_path, progress=True)
    for t in range(6):
        m.log(record(t, loss=1.0))
    m.close()
    err = capsys.readouterr().err
    assert "\r" not in err and "train:" not in err, err  # no tqdm bar in a redirected log


def test_pretrain_log_is_appended_across_attempts(tmp_path):
    for attempt in range(2):
        m = logger(tmp_path)
        m.message(f"attempt {attempt}")
        m.close()
    text = (tmp_path / LOG_FILE).read_text()
    assert "attempt 0" in text and "attempt 1" in text


def test_the_pipeline_bubble_reaches_the_line_on_log_steps_only(tmp_path, capsys):
    m = logger(tmp_path, total_steps=10, log_every=4, progress=False)
    cfg = RunConfig.from_dict({"train": {"steps": 10, "eval_every": 0}, "logging": {"log_every": 4}})
    trainer = Trainer(cfg, Scripted(stops_at_any_step=True), m)
    trainer.run()
    m.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "iteration" in line]
    assert [re.search(r"iteration +(\d+)/", line).group(1) for line in lines] == ["4", "8", "10"]
    assert all("bubble 0.250 mean, 0.300 max (stage 0; so far)" in line for line in lines)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "bubble_fraction" in r] == [3, 7, 9]
    assert all(r["bubble_fraction_per_stage"] == [0.3, 0.2] for r in records if "bubble_fraction" in r)


def test_mfu_needs_a_peak_on_cpu():
    assert device_peak_tflops("cpu", "bf16") is None
    assert device_peak_tflops("cpu", "bf16", override=100.0) == 100.0
    assert Throughput(1e9, 1, None).mfu(1000.0) is None
    assert set(PEAK_TFLOPS) >= {"H100", "H200", "A100"} and all(set(p) == {"bf16", "fp32"} for p in PEAK_TFLOPS.values())


def test_mfu_is_reported_as_missing_on_cpu_without_override(tmp_path, capsys):
    m = logger(tmp_path, throughput=Throughput(1e9, 1, None), progress=False)
    for t in range(3):
        m.log(record(t, 1.0))
    m.close()
    assert "MFU n/a (no peak for this device; set train.peak_tflops)" in capsys.readouterr().out


def test_peak_memory_is_the_process_high_water_mark_on_cpu():
    before = peak_memory_bytes("cpu")
    block = bytearray(64 * 2**20)  # touch 64 MiB more than anything before (bytearray zero-fills: resident)
    after = peak_memory_bytes("cpu")
    del block
    assert after >= before and after >= 64 * 2**20


@pytest.mark.parametrize("name", ["tiny_dense", "smollm2_135m"])
def test_flops_per_token_is_at_least_six_n(name):
    # A dense model: 6 N with N the non-embedding matmul parameters plus the head, plus attention's term.
    cfg = get_model_config(name)
    h = cfg.hidden_size
    per_layer = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.ffn_hidden_size
    expected = 6 * (cfg.num_layers * per_layer + h * cfg.vocab_size) + cfg.num_layers * 6 * 128 * cfg.num_heads * cfg.head_dim
    assert math.isclose(flops_per_token(cfg, 128), expected, rel_tol=1e-12)


def test_the_summary_is_a_short_table():
    """The console's end of a pipeline run: one row per figure, the per-rank lists summary.json keeps left out."""
    summary = {"steps": 8, "planned_steps": 10, "stopped_at": 8, "final_loss": 4.25, "final_val_loss": math.nan,
               "skipped_steps": 0, "tokens": 16384, "tokens_this_attempt": 8192, "wall_time_s": 12.34,
               "mean_step_time_s": 0.5, "tokens_per_s": 663.9, "bubble_fraction": 0.05,
               "bubble_fraction_per_rank": [0.04, 0.06], "memory_per_rank": [{"peak": 1}] * 2,
               "mean_forward_s_per_rank": [0.1, 0.2], "suggested_stage_layers": [3, 1]}
    text = summary_table(summary, "out/summary.json")
    assert text.splitlines() == [
        "summary (out/summary.json):",
        "  steps                   8 of 10 (stopped at step 8, checkpointed)",
        "  final loss              4.2500",
        "  skipped steps           0",
        "  tokens                  16,384",
        "  wall time               12.3 s",
        "  tokens/s                664",
        "  mean step               500.0 ms",
        "  bubble                  0.050 mean; per rank 0.040 0.060",
        "  suggested stage_layers  [3, 1]"]
