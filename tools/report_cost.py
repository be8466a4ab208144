"""What the study cost and where it ran: CPU time from each run's attempts (study_status.json), the hosts, the
commits of the invocations (study.json), the budget arithmetic, and what a CPU-scale study can say."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tools.report_cells import waits_for_tune
from tools.report_data import Study, table
from tools.study import STATUS, run_status

BUDGET_CPU_HOURS = 8.0
"""The issue's budget for the whole study on the 2-core dev machine."""


@dataclass
class RunCost:
    name: str
    cell: str
    """The first cell the run serves."""
    steps: int
    status: str
    cpu_s: float = 0.0
    """Summed over the attempts that recorded it."""
    attempts: int = 0
    unrecorded: int = 0
    """Attempts without a cpu_s (an older driver, or a run killed before it wrote its status)."""
    hosts: Counter = field(default_factory=Counter)


def run_costs(study: Study) -> list[RunCost]:
    out = []
    for d, manifest in zip(study.dirs, study.manifests):
        for planned in manifest["runs"]:
            name = planned["name"]
            cost = RunCost(name, planned["cells"][0]["cell"], planned["config"]["train"]["steps"], run_status(d, name))
            path = d / name / STATUS
            attempts = json.loads(path.read_text()).get("attempts", []) if path.is_file() else []
            for a in attempts:
                cost.attempts += 1
                cost.hosts[a.get("host") or "unknown"] += 1
                if a.get("cpu_s") is None:
                    cost.unrecorded += 1
                else:
                    cost.cpu_s += a["cpu_s"]
            out.append(cost)
    return out


def _cell_rows(costs: list[RunCost], rate: float) -> list[list[str]]:
    rows = []
    for cell in dict.fromkeys(c.cell for c in costs):
        mine = [c for c in costs if c.cell == cell]
        done = [c for c in mine if c.status == "done"]
        spent = sum(c.cpu_s for c in mine)
        per_step = sum(c.cpu_s for c in done) / sum(c.steps for c in done) if done else float("nan")
        rows.append([f"`{cell}`", f"{len(done)} of {len(mine)}", f"{spent / 3600:.2f}", f"{per_step:.3f}" if done else "—",
                     f"{sum(c.steps for c in mine) * rate / 3600:.2f}"])
    return rows


def cost_section(study: Study) -> list[str]:
    costs = run_costs(study)
    done = [c for c in costs if c.status == "done" and not c.unrecorded]
    steps_done, cpu_done = sum(c.steps for c in done), sum(c.cpu_s for c in done)
    rate = cpu_done / steps_done if steps_done else float("nan")
    planned_steps = sum(c.steps for c in costs)
    spent = sum(c.cpu_s for c in costs)
    hosts = sum((c.hosts for c in costs), Counter())
    unrecorded = sum(c.unrecorded for c in costs)
    lines = [
        f"CPU time is user + system time of each run's `pretrain.py` process, summed over its attempts "
        f"(study_status.json). Spent so far: **{spent / 3600:.2f} CPU-hours** over "
        f"{sum(c.attempts for c in costs)} attempts of {len(costs)} planned runs"
        + (f" ({unrecorded} attempts recorded no CPU time)" if unrecorded else "") + ".",
        "",
        (f"Budget arithmetic: the {len(done)} finished runs took {cpu_done:.0f} CPU-s for {steps_done} steps, "
         f"**{rate:.3f} CPU-s per step** (fixed costs and evaluations included); the plan's {len(costs)} runs are "
         f"{planned_steps} steps, so the whole study is {planned_steps} × {rate:.3f} = "
         f"**{planned_steps * rate / 3600:.2f} CPU-hours** against the budget of {BUDGET_CPU_HOURS:g}"
         + (f": **{planned_steps * rate / 3600 / BUDGET_CPU_HOURS - 1:.0%} over it**."
            if planned_steps * rate / 3600 > BUDGET_CPU_HOURS else ".")
         if done else "Budget arithmetic: no finished run has recorded its CPU time yet."),
        *([("**The tune grid has not ended, so the other cells have no runs planned yet: this projection covers the "
            "grid alone.**")] if waits_for_tune(study) else []),
        ("CPU time per step grows with contention on a shared 2-core machine (short time slices, cold caches at "
        "nice 19), so this figure depends on what else ran beside the study."),
        "",
        table(["cell (first)", "runs finished", "CPU-hours spent", "CPU-s per step", "projected CPU-hours"],
              _cell_rows(costs, rate)),
        "",
        "Where the runs ran (attempts per host): " + (", ".join(f"`{h}` {n}" for h, n in hosts.most_common()) or "—")
        + "".join(f"; on `{h}`: " + ", ".join(c.name for c in costs if h in c.hosts)
                  for h, _ in hosts.most_common()[1:]),  # the runs off the main host, by name
        "",
        table(["invoked (UTC)", "commit", "host", "command"],
              [[inv["time"], f"`{inv.get('commit') or 'unknown'}`", inv.get("host", "—"), f"`{inv['command']}`"]
               for m in study.manifests for inv in m["invocations"]]),
    ]
    return lines


CHECKS = {
    "same-code": "short runs of the study's run configs, one per mechanism and per optimizer, in the study's tree "
                 "and in the final code: the same bits step by step means these runs are runs of the final code",
    "resumed": "every run that was stopped at a checkpoint and resumed, rerun uninterrupted: the same bits step by "
               "step",
    "equivalence": "the equivalence tests of the study's commit, unchanged, run on the final code",
}
"""What each of tools.study_checks' checks shows, in the order the report prints them."""


def checks_section(path: Path) -> list[str]:
    """The checks tools.study_checks recorded (--record) in the report's figure folder, printed as they ran."""
    entries = json.loads(path.read_text()) if path.is_file() else {}
    if not entries:
        return [(f"*No check recorded: `python -m tools.study_checks {{{','.join(CHECKS)}}} ... --record {path}` "
                 "keeps each one here.*")]
    lines = []
    for name in [c for c in CHECKS if c in entries] + sorted(set(entries) - set(CHECKS)):
        lines += [f"**{name}**: {CHECKS.get(name, 'a check')}.", ""]
        for e in entries[name]:
            lines += [f"{e['when']} UTC, exit {e['exit']}:", "", "```", f"$ {e['command']}", *e["lines"], "```", ""]
    return lines


def scale_section(study: Study) -> list[str]:
    """What this study can and cannot say about the paper's 360M and 10B runs (its regime, computed)."""
    runs = [r for rs in study.results.values() for _, r in rs]
    cfg = runs[0].config if runs else {}
    t = cfg.get("train", {})
    tokens = t.get("micro_batch_size", 0) * t.get("num_microbatches", 0) * t.get("seq_len", 0) * t.get("steps", 0)
    model = cfg.get("model", {}).get("name", "?")
    return [
        (f"The runs train `{model}` for {t.get('steps')} steps, {tokens:,} tokens a run; the paper trains SmolLM2-360M "
        "and a 10B model on billions of tokens. So:"),
        "",
        ("- **It can say** whether each mechanism moves the loss in the direction the paper reports and in the same "
        "order across optimizers: the one-step-delayed update, Error Feedback and its λ, gradient-level EF, a "
        "synchronous start, DC-ASGD and PipeDream's depth-dependent delay are properties of the update rule under a "
        "stale gradient, and these runs execute the same update rules (the pipeline-equals-simulator tests tie the "
        "simulator these runs use to the pipelines)."),
        ("- **It cannot say** how large the effects are at 360M or 10B: the runs end early in training, where the loss "
        "still falls fast and a one-step delay costs a different fraction of it; the learning rates were tuned at "
        "this scale; and the paper's late-training behaviour (its long horizons, larger batches, and the 10B model's "
        "depth and width) is not reached. Percentages such as \"EF closes 90% of the gap\" are figures of each "
        "regime, compared here only in direction."),
        ("- A **disagreement** here is evidence about the small, early regime, not a refutation of the 360M/10B "
        "result; its explanation says which regime difference accounts for it where the data shows one."),
    ]
