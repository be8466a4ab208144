"""How a finding of the paper is decided from paired per-seed differences (tools.report's verdicts).

Every finding compares two arms run on the same seeds (same initialisation, same data order), so its
evidence is the list of per-seed differences d_i = arm − reference. The rule, fixed before the data:

1. **pending** while any planned run of the finding's arms has not ended (n of N runs): no verdict.
2. **p < 0.05, two-sided paired t-test** on the d_i: *agrees* when the mean has the paper's sign, else
   *disagrees* (the paper's effect is reversed).
3. otherwise, an **equivalence test** (TOST at 90%, i.e. two one-sided tests at 5%) against a margin stated
   in advance: when the 90% confidence interval of the mean lies inside (−margin, +margin) the effect is
   shown to be smaller than the margin. For a claimed effect that is a *disagreement* (the effect the paper
   reports is absent here); for a claimed absence of gain it is an *agreement*.
4. otherwise **undecided at n seeds**, with the seed count the observed paired SD implies (the smallest n at
   which the same mean and SD would pass step 2 or 3). "Not resolved" without that number cannot occur.

The margins are rules, not numbers: MARGIN_FRACTION (1/4) of a reference effect of the same study
(tools.report_findings says which, per finding), because a correction or a trend that moves the loss by
less than a quarter of what the delay itself costs does not change any conclusion the paper draws.
The Student-t distribution is computed here (regularised incomplete beta) to keep scipy optional.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

ALPHA = 0.05
"""Two-sided level of the paired t-test; the TOST runs two one-sided tests at this level (a 90% interval)."""
MARGIN_FRACTION = 0.25
"""The equivalence margin as a fraction of the finding's reference effect (see the module docstring)."""
MAX_SEEDS = 200
"""Seed counts beyond this are reported as "> MAX_SEEDS" (the effect is as good as zero at this scale)."""


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; converges for x < (a+1)/(a+b+2))."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with df degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


@functools.lru_cache(maxsize=1024)
def t_quantile(q: float, df: int) -> float:
    """The q-quantile (q > 0.5) of Student's t with df degrees of freedom, by bisection on t_two_sided_p
    (cached: seeds_needed asks for the same few hundred quantiles again and again)."""
    target, lo, hi = 2.0 * (1.0 - q), 0.0, 1e3
    for _ in range(64):  # 1e3 / 2^64: far below any printed digit
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > target else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Verdict:
    word: str
    """agrees | disagrees | undecided | pending"""
    test: str
    """The test as computed: "paired t(4) = 3.10, p = 0.036", "TOST ±0.010: 90% CI [...]", "3 of 10 runs"."""
    reason: str = ""
    """Why, in words: the reversed sign, the effect inside the margin, the seeds needed, the runs missing."""

    def text(self) -> str:
        """"agrees", "disagrees, because …", "undecided at n seeds; … implies N seeds", "pending (n of N runs)"."""
        if not self.reason:
            return self.word
        return {"pending": f"pending ({self.reason})", "disagrees": f"disagrees, because {self.reason}",
                "undecided": f"undecided {self.reason}"}.get(self.word, f"{self.word}, {self.reason}")


def pending(ended: int, planned: int) -> Verdict:
    """No verdict while runs of the finding's arms are still to come."""
    return Verdict("pending", "—", f"{ended} of {planned} runs" if planned else "its runs wait for the tune grid")


def _passes(mean: float, sd: float, n: int, margin: float | None) -> bool:
    """Would n seeds with this mean and paired SD pass the t-test or the TOST?"""
    if n < 2:
        return False
    se = sd / math.sqrt(n)
    if abs(mean) > t_quantile(1 - ALPHA / 2, n - 1) * se:
        return True
    return margin is not None and abs(mean) + t_quantile(1 - ALPHA, n - 1) * se < margin


def seeds_needed(mean: float, sd: float, margin: float | None) -> int | None:
    """The smallest seed count at which this mean and paired SD would decide the finding (None: > MAX_SEEDS)."""
    return next((n for n in range(2, MAX_SEEDS + 1) if _passes(mean, sd, n, margin)), None)


def decide(diffs: Sequence[float], expected: int, margin: float | None) -> Verdict:
    """The verdict on per-seed paired differences (all planned runs ended: the caller checks `pending`).

    expected: +1 the paper's arm is higher (e.g. the delay raises the loss), −1 lower, 0 the paper claims no
    gain (the arm is not lower than the reference by more than the margin). margin: the equivalence margin
    (> 0), or None when the finding has none (a sign that cannot be shown absent)."""
    n = len(diffs)
    if margin is not None and not (math.isfinite(margin) and margin > 0):
        margin = None  # a reference effect of zero or the wrong sign gives no usable margin
    if n < 2:
        return Verdict("undecided", f"{n} paired seed{'s' * (n != 1)}", f"at {n} seeds: a paired test needs two")
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    t = math.copysign(math.inf, mean) if se == 0 and mean != 0 else 0.0 if se == 0 else mean / se
    p = t_two_sided_p(t, n - 1)
    test = f"paired t({n - 1}) = {t:+.2f}, p = {p:.3g}"
    if p < ALPHA:
        if expected == 0:
            return Verdict("agrees" if mean > 0 else "disagrees", test,
                           "" if mean > 0 else f"the arm is lower by {-mean:.4f} (p = {p:.3g})")
        if (mean > 0) == (expected > 0):
            return Verdict("agrees", test)
        return Verdict("disagrees", test, f"the sign is reversed: {mean:+.4f} (p = {p:.3g})")
    if margin is not None:
        half = t_quantile(1 - ALPHA, n - 1) * se
        test += f"; TOST ±{margin:.4f}: 90% CI [{mean - half:+.4f}, {mean + half:+.4f}]"
        if abs(mean) + half < margin:
            if expected == 0:
                return Verdict("agrees", test)
            return Verdict("disagrees", test, f"the effect is absent here: within ±{margin:.4f} (TOST, 90%)")
    needed = seeds_needed(mean, sd, margin)
    return Verdict("undecided", test, f"at {n} seeds; the paired SD {sd:.4f} implies "
                   + (f"{needed} seeds" if needed else f"more than {MAX_SEEDS} seeds"))
