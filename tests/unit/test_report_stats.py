"""How tools.report_stats reaches each verdict, on synthetic paired differences; the Student-t it computes
against the printed tables."""

from __future__ import annotations

import random
import re
import statistics

import pytest

from tools.report_stats import MAX_SEEDS, decide, pending, seeds_needed, t_quantile, t_two_sided_p


@pytest.mark.parametrize("q, df, table", [(0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 4, 2.776),
                                          (0.975, 9, 2.262), (0.975, 30, 2.042), (0.95, 1, 6.314),
                                          (0.95, 4, 2.132), (0.95, 7, 1.895)])
def test_student_t_quantiles_match_the_tables(q, df, table):
    assert round(t_quantile(q, df), 3) == table
    assert t_two_sided_p(table, df) == pytest.approx(2 * (1 - q), abs=2e-4)


def with_mean_sd(mean: float, sd: float, n: int) -> list[float]:
    """n values whose sample mean and SD are exactly these (a centred, scaled ramp)."""
    ramp = [i - (n - 1) / 2 for i in range(n)]
    scale = statistics.stdev(ramp)
    return [mean + sd * r / scale for r in ramp]


@pytest.mark.parametrize("diffs, expected, margin, word, reason", [
    # the paper's sign at p < 0.05
    (with_mean_sd(0.30, 0.05, 5), +1, None, "agrees", ""),
    (with_mean_sd(-0.10, 0.02, 5), -1, 0.05, "agrees", ""),
    # the opposite sign at p < 0.05: a reversed effect
    (with_mean_sd(-0.10, 0.02, 5), +1, None, "disagrees", "the sign is reversed"),
    # not significant, but the 90% CI inside the margin: the paper's effect is absent here
    (with_mean_sd(0.001, 0.01, 5), -1, 0.05, "disagrees", "the effect is absent here"),
    # a claimed absence of gain: worse at p < 0.05, or equivalent, agrees; better at p < 0.05 disagrees
    (with_mean_sd(0.10, 0.02, 5), 0, 0.05, "agrees", ""),
    (with_mean_sd(0.001, 0.01, 5), 0, 0.05, "agrees", ""),
    (with_mean_sd(-0.10, 0.02, 5), 0, 0.05, "disagrees", "the arm is lower"),
    # neither: undecided, with the seeds the paired SD implies
    (with_mean_sd(0.02, 0.05, 5), +1, None, "undecided", "at 5 seeds; the paired SD 0.0500 implies"),
    (with_mean_sd(0.02, 0.05, 5), +1, 0.01, "undecided", "at 5 seeds"),
    ([0.3], +1, 0.1, "undecided", "a paired test needs two"),
])
def test_each_verdict_on_synthetic_differences(diffs, expected, margin, word, reason):
    verdict = decide(diffs, expected, margin)
    assert verdict.word == word, verdict
    assert reason in verdict.reason if reason else verdict.reason == ""
    assert verdict.test.startswith("paired t(") or len(diffs) < 2


def test_the_implied_seed_count_decides_and_one_fewer_does_not():
    mean, sd = 0.02, 0.05
    needed = seeds_needed(mean, sd, None)
    assert needed is not None and needed > 5
    assert f"implies {needed} seeds" in decide(with_mean_sd(mean, sd, 5), +1, None).reason
    assert decide(with_mean_sd(mean, sd, needed), +1, None).word == "agrees"
    assert decide(with_mean_sd(mean, sd, needed - 1), +1, None).word == "undecided"
    # with a margin the equivalence test may decide first: a mean near zero is shown absent
    needed = seeds_needed(0.001, sd, 0.04)
    assert decide(with_mean_sd(0.001, sd, needed), +1, 0.04).word == "disagrees"
    assert decide(with_mean_sd(0.001, sd, needed - 1), +1, 0.04).word == "undecided"


def test_complete_data_never_ends_without_a_verdict_or_a_seed_count():
    rng = random.Random(0)
    words = set()
    for _ in range(300):
        n = rng.randint(2, 9)
        diffs = [rng.gauss(rng.uniform(-0.1, 0.1), rng.uniform(0.001, 0.1)) for _ in range(n)]
        margin = rng.choice([None, rng.uniform(0.005, 0.1)])
        verdict = decide(diffs, rng.choice([-1, 0, 1]), margin)
        words.add(verdict.word)
        assert verdict.word in ("agrees", "disagrees", "undecided")
        if verdict.word == "undecided":
            m = re.search(r"implies (\d+) seeds|more than (\d+) seeds", verdict.reason)
            assert m, verdict
            if m.group(1):  # that many seeds with the same mean and SD decide the finding
                implied = with_mean_sd(statistics.fmean(diffs), statistics.stdev(diffs), int(m.group(1)))
                assert decide(implied, +1, margin).word != "undecided"
            else:
                assert int(m.group(2)) == MAX_SEEDS
    assert words == {"agrees", "disagrees", "undecided"}


def test_pending_names_the_runs():
    verdict = pending(3, 10)
    assert verdict.word == "pending" and verdict.text() == "pending (3 of 10 runs)"


def test_the_verdict_reads_as_the_issue_asks():
    assert decide(with_mean_sd(-0.10, 0.02, 5), +1, None).text().startswith("disagrees, because the sign is reversed")
    assert decide(with_mean_sd(0.02, 0.05, 5), +1, None).text().startswith("undecided at 5 seeds; the paired SD")
    assert decide(with_mean_sd(0.30, 0.05, 5), +1, None).text() == "agrees"
