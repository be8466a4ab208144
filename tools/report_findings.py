"""The paper's findings checked against a study: one Finding per claim, decided by tools.report_stats.decide.

Each finding names its arms (cell, row, column), the per-seed paired difference it tests, the sign the paper
reports and its equivalence margin. Margins are rules fixed before the data (MARGIN_FRACTION = 1/4 of a
reference effect measured in the same study, on the same seeds):
- the delay's own gap (2BW − sync): 1/4 of the paper's relative gap for that optimizer, scaled to our sync
  loss: a gap under a quarter of what the paper measured (relative to the loss) is taken as absent;
- a correction (EF, DC-ASGD, sync start vs EF, gradient-level EF, λ, PipeDream vs 2BW): 1/4 of the row's
  2BW − sync gap: moving the loss by less than a quarter of what the delay costs changes no conclusion;
- the gap ordering: 1/4 of the larger of the two gaps;
- the momentum trend: 1/4 of Muon's 2BW gap at momentum 0.95 (the paper's default; proposed in the plan's
  seed table, notes h46).
A disagreement's explanation is written by whoever reads the data, in EXPLANATIONS (key -> text); until
then the report shows the empty slot by name.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from tools.report_data import (
    MAIN_COLUMNS,
    Stat,
    Study,
    closes,
    columns_where,
    ended,
    first_nonfinite,
    fmt_diff,
    gap_stat,
    is_plain_2bw,
    is_sync,
    paired,
    paired_diffs,
    reference,
    stat,
)
from tools.report_stats import MARGIN_FRACTION, Verdict, decide, pending

#: Table 1/2 of the paper, SmolLM2-360M final validation loss: (sync, async, async + EF). Digest §5.1-5.2.
PAPER_360M = {"muon": (2.578, 2.590, 2.583), "adamw": (2.612, 2.890, 2.640), "soap": (2.581, 2.608, 2.590)}
MOMENTUM_REFERENCE = 0.95
"""Muon's momentum whose 2BW gap sets the momentum trend's margin (the paper's and the optimizer's default)."""

# Written at 8 of 8 seeds of grad_ef_long_more_seeds (session 12), for both λ; the figures are that cell's
# step table, every run's validation curve (lowest at its last evaluation) and grad_ef_long's curves.
ADAMW_GRAD_EF_LONG = (
    "here the corrected gradient is bounded before it can feed back, and for AdamW the bounded correction helps. "
    "Over 400 steps no run diverged: each of the 32 runs has its lowest validation loss at its last evaluation. At λ "
    "= 1 the corrected gradient g_t + (g_t − g_{t−1}) exceeds train.grad_clip = 1 on every step of the second half "
    "but 1% (norm 1.277 against 0.425 for plain 2BW), so clipping scales it back, and Adam's second moment, fed "
    "these larger gradients, shrinks the step: the update's norm is 0.264 against 0.448. At λ = 0.5 the gradient is "
    "clipped on 3% of the steps and the update is 0.353. The paper's divergence (Fig. 19: SmolLM2-135M over a far "
    "longer run, its optimizer not given) needs the correction's noise to grow the step, and with clipping and "
    "Adam's normalization it cannot here. What is left is the extrapolation: the corrected gradient leans toward "
    "where the gradient is going, and the delayed AdamW run, which stalls after warmup (`adamw_lr`), descends faster "
    "through the stall with it (the training loss of `grad_ef_long`).")
"""Why AdamW's gradient-level EF does not diverge over 400 steps: one text for λ = 0.5 and λ = 1."""

EXPLANATIONS: dict[str, str] = {
    # Written at 5 of 5 seeds of the grad_ef cell (session 11); the figures are the cell's step table's.
    "grad_ef/muon/grad_ef1": (
        "here the correction cannot grow Muon's step. The corrected gradient g_t + (g_t − g_{t−1}) is 2.7× the "
        "plain delayed one (second half: norm 1.518 against 0.562, the step table of `grad_ef`) and exceeds "
        "train.grad_clip = 1 on every step, so clipping scales it back to norm 1; Muon then orthogonalizes its "
        "momentum, which drops the scale again, and the update comes out smaller than plain 2BW's (0.641 against "
        "0.835): the correction's noise is bounded, not fed back. The paper's divergence (Fig. 19: a 135M model "
        "over a far longer run, its optimizer not given) is not reached in 200 steps with both bounds in place; "
        "the longer AdamW runs (`grad_ef_long`) test the horizon."),
    # Written at 10 of 10 seeds of main_more_seeds (session 12); the figures are the cell's step table's.
    "main_more_seeds/lion/ef": (
        "here EF raises Lion's loss because it amplifies Lion's noisiest coordinates instead of correcting a drift. "
        "Lion's update is lr·sign(c) per coordinate, so u_t − u_{t−1} is zero where the sign holds and ±2·lr where "
        "it flips; EF at λ = 1, 2u_t − u_{t−1}, triples the step of exactly the coordinates that flip, those whose "
        "momentum sits near zero, where the delayed gradient's sign is least reliable. EF raises Lion's update norm "
        "by 34% (second half: 0.3965 → 0.5317; for the other optimizers +7% to +21%, the main table's step table), "
        "so about 10% of the coordinates flip each step (√(1 + 8q) = 1.34 gives q ≈ 0.10). A method whose update "
        "differences are sign flips has no smooth drift for EF to extrapolate. The paper states EF's gain \"for most "
        "optimizers\" (Fig. 2) without giving Lion's row."),
    # Written at 10 of 10 seeds of sync_start_more_seeds (session 12); the figures are that cell's table and
    # adamw_lr's.
    "sync_start_more_seeds/adamw": (
        "here neither a synchronous start nor EF reaches the place where AdamW's gap is built, so the two cannot "
        "differ by much. The gap opens in a stall after warmup (`adamw_lr`: at lr 0.004, from step 60 to 200, "
        "2BW falls 0.43 against sync's 1.02). The synchronous start covers the first 20 steps, the warmup, and "
        "ends where the stall begins: it closes 1% of the gap (−0.016 ± 0.086, n.s.). EF shortens the stall a "
        "little and closes 10% (−0.111 ± 0.114). EF − sync start is negative, as in the paper, but smaller than "
        "the margin fixed in advance (a quarter of AdamW's gap): that gap is 1.10, and a quarter of it (0.274) is "
        "more than EF's whole effect here. For Muon, whose gap is 0.26, EF beats the synchronous start clearly."),
    "grad_ef_long_more_seeds/adamw/grad_ef1_long": ADAMW_GRAD_EF_LONG,
    "grad_ef_long_more_seeds/adamw/grad_ef0.5_long": ADAMW_GRAD_EF_LONG,
    # Written once momentum (5 seeds) and momentum_adamw_part (5 seeds) had ended (session 12); the figures are
    # their tables and their gap-over-steps tables.
    "momentum/muon": (
        "here a 200-step run is too short for high momentum to pay off, so the delay's one step is not diluted by "
        "it. Higher momentum costs the synchronous run itself (final loss 4.700, 4.785, 4.872 at μ = 0.9, 0.95, "
        "0.98): its buffer averages about 1/(1 − μ) steps, 50 at 0.98, a quarter of the run, while the loss is "
        "still falling fast. The delay adds one more step of lag, and early on it costs more the higher μ is (gap "
        "at step 40: +0.478, +0.616, +0.673); the higher-μ gaps then close faster, and by step 200 the three meet "
        "(+0.256, +0.260, +0.258). The paper measures the end of far longer runs, where the averaging window is a "
        "small part of training. A structural cause was tested and ruled out: tiny_dense's tied embedding, 57% of "
        "its parameters, is trained by Muon's AdamW part with β1 = 0.9 at every μ. Moving β1 with μ "
        "(`momentum_adamw_part`) does not bring the paper's trend out. It makes the opposite order stronger: the "
        "gap at 0.98 is +0.321 against +0.256 at 0.9, and larger at every evaluation. More momentum anywhere means "
        "more lag, and at this horizon more lag makes the delay cost more."),
    # Written at 3 of 3 seeds of the dc_asgd cell (session 12); the figures are its two tables'.
    "dc_asgd/muon/dc10000": (
        "here DC-ASGD's correction acts in the early phase, a large share of a 200-step run. The correction λ "
        "g⊙g⊙(x_t − x_{t−1}) grows with the square of the gradient. Over the first 20% of the steps (warmup and the "
        "loss spike after it) the corrected gradient's norm at λ = 10⁴ averages 34, against 3.5 for plain 2BW, so "
        "early on the step follows the correction more than the gradient. In the second half it is no larger than "
        "plain 2BW's (0.566 against 0.562). The advantage is there by step 40 (gap to sync 0.613 against 0.652) and "
        "is then held, not grown (0.040 at step 200). At λ = 10³ the correction stays small early (3.58 against "
        "3.50) and there is no significant effect. The paper's Fig. 14 measures SmolLM2-135M after a far longer run, "
        "in which those first steps are a far smaller share, and does not give its λ grid (λ = 10⁴ may lie outside "
        "it); whether the advantage outlasts a longer run, these 200 steps cannot say."),
}
"""Finding key -> why this study disagrees with the paper there, written after reading the data."""

READINGS: dict[str, str] = {
    # Written once adamw_lr had ended (3 of 3 seeds per lr, session 12); figures from its two tables.
    "adamw_lr": (
        "AdamW's gap does not come from a learning rate at the edge of stability. Halving the tuned lr leaves it "
        "where it was (+1.014 at 0.002, +1.076 at 0.004); doubling it shrinks the gap only because sync itself gets "
        "worse (6.05 ± 0.44 at 0.008), and that gap is not told from zero. The training-loss table shows where the "
        "gap opens. At every lr all three arms come down to about 7.0-7.1 by step 30, ten steps after warmup. Sync "
        "then keeps falling, while 2BW stalls: at 0.004, from step 60 to step 200 sync falls 1.02 (6.64 to 5.62) "
        "and 2BW 0.43 (7.10 to 6.67); at 0.002, 1.07 against 0.49. The gap is built in that stalled phase and has "
        "not closed by step 200; over 400 steps it grows (`grad_ef_long`: +1.36). EF shortens the stall a little "
        "at every lr (its curve lies between the other two), closing 16-31% of the gap, not the paper's 90%. That "
        "is the regime difference: the paper measures its 360M runs at 2.6 nats, long after such a phase, where "
        "the delay costs AdamW 0.28; these 200 steps lie inside the phase where the loss falls from 7 to 5.5 and "
        "the delay stalls AdamW. The gap here, and EF's share of it, are figures of that early phase."),
    # Written once ef_lambda had ended (5 of 5 seeds, session 12); the figures are its table and step table.
    "ef_lambda": (
        "For both optimizers the loss falls from λ = 0 to λ = 2 and rises again at 3 (AdamW 6.645, 6.626, 6.468, "
        "6.378, 6.481; Muon 5.045, 4.956, 4.926, 4.921, 4.939), as in the paper's Fig. 15 (best somewhat above 1). "
        "The correction adds λ(u_t − u_{t−1}) to each update, and the step table shows its price: the update's "
        "norm grows with λ (AdamW 0.324 to 0.518, Muon 0.835 to 1.642 from λ = 0 to 3), while the gradient's "
        "norm barely moves. Up to λ = 2 the extrapolation gains more than the larger step costs; at 3 it no "
        "longer does. For AdamW even the best λ closes only 25% of the gap, and the seed spread is as large as "
        "the differences between λs: its best-λ finding is decided on the 10 seeds of `ef_lambda_more_seeds`."),
    # Written once grad_ef_long_more_seeds had ended (8 of 8 seeds, session 12); the figures are its table and
    # step table and the curves below.
    "grad_ef_long": (
        "Over twice the steps nothing diverges, and the delay's cost for AdamW keeps growing: the gap is +1.33 at "
        "step 400 (8 seeds, `grad_ef_long_more_seeds`) against +1.08 at step 200 (the main table). Every one of "
        "the 32 runs has its lowest validation loss at its last evaluation. Gradient-level EF lowers the delayed "
        "loss at both λ, by 0.195 at 0.5 and 0.374 at 1 (15% and 28% of the gap), the opposite of the paper's "
        "divergence: at λ = 1 the corrected gradient is clipped on 99% of the second half's steps and the update "
        "is smaller than plain 2BW's (0.264 against 0.448). In the training-loss curves (3 seeds), λ = 1 leaves "
        "plain 2BW's path from about step 60, inside the post-warmup stall, λ = 0.5 from about step 150, and both "
        "stay below it to the end. The findings table gives why this differs "
        "from the paper."),
    # Written in session 12, from the plan file's arithmetic and the table above.
    "cost": (
        "The budget is not met, for two reasons. (1) The plan was sized at 0.50 CPU-s per step plus 10.6 CPU-s "
        "per run, both measured inside one process at 5 and 25 steps: about 116 CPU-s for a 200-step run. Each "
        "run of the study is its own pretrain.py process, with its interpreter start-up, config composition, an "
        "evaluation every 40 steps and a checkpoint every 50. Two such processes share the two cores at nice 19, "
        "beside the session's other work. The rate above is what they took, start-up included. At that rate the "
        "222 runs first planned (54,000 steps) come to about 10.5 CPU-hours, not 7.5. (2) The plan grew by 75 "
        "runs, 20 of them 400 steps long, because four findings were still undecided at their planned seeds and "
        "the momentum finding's explanation needed a test (the plan file gives each cell's reason). Deciding every "
        "finding came before the budget, and no cell was cut after its data had been seen: stopping a cell on "
        "its own data biases its test. A study sized at the measured rate fits about 41,000 steps into 8 "
        "CPU-hours (8 × 3600 / 0.70), 205 runs of 200 steps."),
    # Written in session 12 from the checks above.
    "checks": (
        "Every run's code is 13a0011's: the study's later commits change only the plan file and, in 5dbed87, the "
        "study driver's naming of a run directory. The same-code check is the direct evidence that the final code "
        "computes these runs: a 12-step run of each mechanism's and each optimizer's config, with an evaluation, a "
        "checkpoint and a synchronous start inside it, gives the same bits at every step in the study's tree and in "
        "the final code. The equivalence tests of 13a0011, unchanged, pass on the final code except five, and none "
        "of the five fails on a number: each reaches an API that has moved or was removed since (the fault test's "
        "hook on PipelineExecutor._forward, now StageForward.__call__; the Megatron log line's padding, changed with "
        "the console; the vocabulary-parallel loss on one rank, which now refuses and names core.loss.cross_entropy; "
        "the removed test-only head's helper module, tests/dist/vocab_workers; compute_dtype_of, moved to "
        "asyncpp.core.masters). Their current versions are in the final code's default suite and pass."),
}
"""Cell name (or "cost" and "checks", the sections on cost and on the code) -> what its table and figure say,
written after reading the data (the AdamW explanation lives in its cells' readings). Shown under the section; a
cell in NEEDS_READING without one shows its empty slot."""
NEEDS_READING = ("adamw_lr", "ef_lambda", "grad_ef_long")


def reading(cell: str) -> str:
    if cell in READINGS:
        return f"**Reading.** {READINGS[cell]}"
    return f"*to write: READINGS[{cell!r}] in tools/report_findings.py*" if cell in NEEDS_READING else ""


@dataclass(frozen=True)
class Finding:
    key: str
    """A stable name (EXPLANATIONS' key), e.g. "main/adamw/ef"."""
    paper: str
    """The paper's finding in words."""
    paper_figure: str
    """What the paper reports (its numbers, or the figure that shows it)."""
    ours: str
    verdict: Verdict

    def explanation(self) -> str:
        if self.verdict.word != "disagrees":
            return ""
        return EXPLANATIONS.get(self.key, f"*to write: EXPLANATIONS[{self.key!r}] in tools/report_findings.py*")


def judge(key: str, paper: str, figure: str, ours: str, arms: list[Stat], diffs: list[float], expected: int,
          margin: float | None) -> Finding:
    """pending until every planned run of the arms has ended, then tools.report_stats.decide."""
    done, planned = ended(arms)
    if done < planned or planned == 0:  # partial numbers are shown, marked as such, and decide nothing
        return Finding(key, paper, figure, f"so far: {ours}", pending(done, planned))
    return Finding(key, paper, figure, ours, decide(diffs, expected, margin))


MORE_SEEDS = "_more_seeds"
"""`<cell>_more_seeds` repeats some of <cell>'s rows at more seeds (added when a finding was undecided at the
planned seeds; its first seeds are <cell>'s runs, shared): where it has a row, that row's findings are decided on
it."""


def deciding(study: Study, cell: str, row: str) -> str:
    """The cell whose runs decide the findings of (cell, row)."""
    more = cell + MORE_SEEDS
    return more if row in study.cells.get(more, {}).get("rows", []) else cell


def _where(cell: str, nominal: str) -> str:
    """" (`cell`)" when a finding is decided on another cell than the one it belongs to."""
    return f" (`{cell}`)" if cell != nominal else ""


def row_gap(study: Study, cell: str, row: str) -> float:
    """Mean over paired seeds of (plain 2BW − sync) in (cell, row); NaN without both columns."""
    sync_col, base = reference(study, cell, row, is_sync), reference(study, cell, row, is_plain_2bw)
    if not (sync_col and base):
        return math.nan
    return paired(stat(study, cell, row, base), stat(study, cell, row, sync_col))[0]


def _quarter(effect: float) -> float | None:
    return MARGIN_FRACTION * effect if math.isfinite(effect) and effect > 0 else None


def findings(study: Study) -> list[Finding]:
    """Every finding the study's cells can test, in the report's order."""
    cells, out = study.cells, []
    for row in cells.get("main", {}).get("rows", []):
        out += _main(study, row)
    out += _gap_ordering(study)
    for row in cells.get("ef_lambda", {}).get("rows", []):
        out.append(_best_lambda(study, row))
    long_rows = set(cells.get("grad_ef_long", {}).get("rows", []))
    for name in ("grad_ef", "grad_ef_long"):
        for row in cells.get(name, {}).get("rows", []):
            if name == "grad_ef_long" or row not in long_rows:  # the longer horizon decides where it ran
                out += _treatments(study, deciding(study, name, row), row, "gradient-level EF diverges",
                                   "Fig. 19: diverges", +1)
    for row in cells.get("dc_asgd", {}).get("rows", []):
        out += _treatments(study, deciding(study, "dc_asgd", row), row, "no DC-ASGD coefficient beats plain delay",
                           "Fig. 14", 0)
    for row in cells.get("sync_start", {}).get("rows", []):
        out.append(_sync_start(study, row))
    for row in cells.get("pipedream", {}).get("rows", []):
        out.append(_pipedream(study, row))
    if "momentum" in cells:
        out.append(_momentum(study))
    return out


def _main(study: Study, opt: str) -> list[Finding]:
    cell = deciding(study, "main", opt)
    s, a, e = (stat(study, cell, opt, c) for c in MAIN_COLUMNS)
    paper = PAPER_360M.get(opt)
    gap = paired(a, s)
    if paper:
        ps, pa, pe = paper
        gap_fig, ef_fig = f"{ps:.3f} → {pa:.3f} (gap {pa - ps:+.3f})", f"{pa:.3f} → {pe:.3f} ({(pa - pe) / (pa - ps):.0%} of the gap)"
        gap_margin = _quarter((pa - ps) / ps * s.mean)
    else:
        gap_fig, ef_fig, gap_margin = "—", "EF closes most of the gap for most optimizers", None
    closed = closes(study, cell, opt, "2bw_ef", "sync", "2bw")
    where = _where(cell, "main")
    return [judge(f"{cell}/{opt}/gap", f"{opt}: one-step delay raises the loss", gap_fig,
                  f"gap {fmt_diff(gap)}{where}", [s, a], paired_diffs(a, s), +1, gap_margin),
            judge(f"{cell}/{opt}/ef", f"{opt}: EF lowers the delayed loss", ef_fig,
                  f"async+EF − async {fmt_diff(paired(e, a))}; gap closed {closed}{where}",
                  [s, a, e], paired_diffs(e, a), -1, _quarter(gap[0]))]


def _gap_pair(study: Study, hi: str, lo: str) -> Finding:
    """hi's sync-async gap exceeds lo's: per-seed gaps paired by seed, from gap_order when it has both rows."""
    cell = "gap_order" if {hi, lo} <= set(study.cells.get("gap_order", {}).get("rows", [])) else "main"
    arms = [stat(study, cell, o, c) for o in (hi, lo) for c in ("sync", "2bw")]
    g_hi, g_lo = gap_stat(study, cell, hi, "2bw", "sync"), gap_stat(study, cell, lo, "2bw", "sync")
    ph, pl = (PAPER_360M[o][1] - PAPER_360M[o][0] for o in (hi, lo))
    diff = paired(g_hi, g_lo)
    means = [g.mean for g in (g_hi, g_lo) if g.values]
    ours = f"{hi} {_signed(g_hi.mean)}, {lo} {_signed(g_lo.mean)}; {hi} − {lo} {fmt_diff(diff)} (`{cell}`)"
    return judge(f"{cell}/{hi}>{lo}", f"{hi}'s sync-async gap is larger than {lo}'s", f"{ph:+.3f} vs {pl:+.3f}",
                 ours, arms, paired_diffs(g_hi, g_lo), +1, _quarter(max(means)) if len(means) == 2 else None)


def _signed(x: float) -> str:
    return f"{x:+.4f}" if math.isfinite(x) else "—"


def _gap_ordering(study: Study) -> list[Finding]:
    rows = study.cells.get("main", {}).get("rows", [])
    ranked = sorted((o for o in PAPER_360M if o in rows), key=lambda o: PAPER_360M[o][0] - PAPER_360M[o][1])
    return [_gap_pair(study, hi, lo) for hi, lo in itertools.pairwise(ranked)]


def _best_lambda(study: Study, row: str) -> Finding:
    """The claim is where the optimum lies, so the best arm at λ ≥ 1 is paired with the best at λ < 1 (picking
    each group's best before the test slightly favours deciding: a selection effect, kept for so few arms)."""
    cell = deciding(study, "ef_lambda", row)
    cols = [c for c in study.cells[cell]["columns"] if study.xs.get((cell, row, c)) is not None]
    stats = {c: stat(study, cell, row, c) for c in cols}
    arms = [stat(study, cell, row, c) for c in study.cells[cell]["columns"]]  # sync too: the margin
    lam = {c: study.xs[(cell, row, c)] for c in cols}
    high, low = [c for c in cols if lam[c] >= 1], [c for c in cols if lam[c] < 1]
    key, paper, fig = f"{cell}/{row}", f"{row}: the best EF λ is ≥ 1", "Fig. 15: best somewhat above 1"
    if not (high and low) or any(not s.values for s in stats.values()):
        return judge(key, paper, fig, "some λ not finished", arms, [], +1, None)
    best_high, best_low = (min(group, key=lambda c: stats[c].mean) for group in (high, low))
    best = min(cols, key=lambda c: stats[c].mean)
    diff = paired(stats[best_low], stats[best_high])  # > 0: the best λ ≥ 1 is lower
    ours = (f"best λ = {lam[best]:g} ({stats[best].mean:.4f}); λ={lam[best_low]:g} − λ={lam[best_high]:g} "
            f"{fmt_diff(diff)}{_where(cell, 'ef_lambda')}")
    return judge(key, paper, fig, ours, arms, paired_diffs(stats[best_low], stats[best_high]), +1,
                 _quarter(row_gap(study, cell, row)))


def _treatments(study: Study, cell: str, row: str, claim: str, fig: str, expected: int) -> list[Finding]:
    """Each treatment column of (cell, row) against plain 2BW. expected +1: worse than 2BW or every run diverged
    (a diverged run has no final loss to pair); 0: not better than 2BW by more than the margin."""
    base = reference(study, cell, row, is_plain_2bw)
    sync_col = reference(study, cell, row, is_sync)
    treated = [c for c in study.cells[cell]["columns"] if c not in (base, sync_col)]
    out = []
    for column in treated if base else []:
        st, b = stat(study, cell, row, column), stat(study, cell, row, base)
        diverged = st.statuses.get("diverged", 0)
        diff = paired(st, b)
        steps = sorted(s for _, r in study.results[(cell, row, column)] if (s := first_nonfinite(r)) is not None)
        ours = (f"{diverged} of {st.planned} diverged (non-finite at step {', '.join(map(str, steps))}); "
                if diverged else "") + f"{column} − 2BW {fmt_diff(diff)}"
        key, paper = f"{cell}/{row}/{column}", f"{row}: {claim} ({column})"
        arms = [st, b] + ([stat(study, cell, row, sync_col)] if sync_col else [])  # sync: the margin's gap
        found = judge(key, paper, fig, ours, arms, paired_diffs(st, b), expected, _quarter(row_gap(study, cell, row)))
        if expected > 0 and diverged and diverged == st.planned and found.verdict.word != "pending":
            found = Finding(key, paper, fig, ours, Verdict("agrees", f"{diverged} of {st.planned} runs diverged"))
        out.append(found)
    return out


def _sync_start(study: Study, row: str) -> Finding:
    cell = deciding(study, "sync_start", row)
    starts = columns_where(study, cell, row, lambda c: c["staleness"]["sync_start_steps"] > 0)
    efs = columns_where(study, cell, row, lambda c: c["staleness"]["ef_lambda"] > 0)
    arms = [stat(study, cell, row, c) for c in study.cells[cell]["columns"]]
    e, s = (stat(study, cell, row, cols[0]) if cols else Stat() for cols in (efs, starts))
    return judge(f"{cell}/{row}", f"{row}: EF beats a synchronous start", "Fig. 2",
                 f"EF − sync start {fmt_diff(paired(e, s))}{_where(cell, 'sync_start')}", arms, paired_diffs(e, s), -1,
                 _quarter(row_gap(study, cell, row)))


def _pipedream(study: Study, row: str) -> Finding:
    key, paper, fig = f"pipedream/{row}", f"{row}: original PipeDream degrades as P grows, 2BW does not", "Fig. 6"
    sync_col, base = reference(study, "pipedream", row, is_sync), reference(study, "pipedream", row, is_plain_2bw)
    pds = sorted((study.xs[("pipedream", row, c)], c) for c in study.cells["pipedream"]["columns"]
                 if study.xs.get(("pipedream", row, c)) is not None)
    arms = [stat(study, "pipedream", row, c) for c in study.cells["pipedream"]["columns"]]
    if not (sync_col and base and pds):
        return judge(key, paper, fig, "—", arms, [], +1, None)
    gaps = [paired(stat(study, "pipedream", row, c), stat(study, "pipedream", row, sync_col)) for _, c in pds]
    deepest, b = stat(study, "pipedream", row, pds[-1][1]), stat(study, "pipedream", row, base)
    ours = ", ".join(f"P={p:g}: {fmt_diff(g)}" for (p, _), g in zip(pds, gaps))
    ours += f"; P={pds[-1][0]:g} − 2BW {fmt_diff(paired(deepest, b))}"
    return judge(key, paper, fig, ours, arms, paired_diffs(deepest, b), +1, _quarter(row_gap(study, "pipedream", row)))


def _momentum(study: Study) -> Finding:
    key, paper, fig = "momentum/muon", "higher momentum, smaller sync-async gap", "Fig. 4"
    keyed, arms = [], []
    for row in study.cells["momentum"]["rows"]:
        sync_col, base = reference(study, "momentum", row, is_sync), reference(study, "momentum", row, is_plain_2bw)
        x = study.xs.get(("momentum", row, base)) if base else None
        if sync_col and base and x is not None:
            keyed.append((x, gap_stat(study, "momentum", row, base, sync_col)))
            arms += [stat(study, "momentum", row, sync_col), stat(study, "momentum", row, base)]
    if len(keyed) < 2:
        return judge(key, paper, fig, "—", arms, [], -1, None)
    keyed.sort(key=lambda t: t[0])
    ref = next((g for x, g in keyed if math.isclose(x, MOMENTUM_REFERENCE)), keyed[len(keyed) // 2][1])
    diff = paired(keyed[-1][1], keyed[0][1])  # gap at the highest momentum minus gap at the lowest, per seed
    ours = ", ".join(f"{x:g}: {_signed(g.mean)}" for x, g in keyed)
    ours += f"; highest − lowest {fmt_diff(diff)}"
    return judge(key, paper, fig, ours, arms, paired_diffs(keyed[-1][1], keyed[0][1]), -1, _quarter(ref.mean))
