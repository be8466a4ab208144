"""Pipeline timelines, predicted (asyncpp.schedules.costmodel) or measured (the engine), on one format.

The engine records `(stage, label, start_s, end_s, kind)` tuples with kind one of events.KINDS (an action's
letter, comm or idle);
the cost model produces the same events in its own time unit. Both render to a Chrome trace
(chrome://tracing, Perfetto) and to a Gantt PNG. Times are seconds for measured runs; predicted
runs use the cost unit, and the trace treats it as seconds too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from asyncpp.schedules.events import KINDS, TimelineEvent

EventLike = TimelineEvent | Sequence[object]


def as_events(events: Iterable[EventLike]) -> list[TimelineEvent]:
    """Accept TimelineEvents or the engine's (stage, label, start_s, end_s, kind) tuples."""
    out = []
    for e in events:
        if not isinstance(e, TimelineEvent):
            stage, label, start, end, kind = e[:5]
            e = TimelineEvent(int(stage), str(label), float(start), float(end), str(kind))
        if e.kind not in KINDS:
            raise ValueError(f"timeline event kind={e.kind!r} is not one of {KINDS}: {e}")
        out.append(e)
    return out


def write_chrome_trace(
    events: Iterable[EventLike], path: str | os.PathLike, *, name: str = "asyncpp"
) -> None:
    """Chrome trace-event JSON: one process, one thread per stage, complete ("X") events in µs."""
    evs = as_events(events)
    stages = sorted({e.stage for e in evs})
    trace: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": name}}]
    for s in stages:
        trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}})
        trace.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": s, "args": {"sort_index": s}})
    for e in evs:
        trace.append(
            {
                "name": e.label,
                "cat": e.kind,
                "ph": "X",
                "pid": 0,
                "tid": e.stage,
                "ts": e.start * 1e6,
                "dur": max(e.duration, 0.0) * 1e6,
                "args": {"step": e.step, "microbatch": e.microbatch},
            }
        )
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


# Two shades per compute kind: alternate steps differ, so a continuous 2BW stream shows its steps.
_COLOURS = {"F": ("#4C72B0", "#8DB0DD"), "B": ("#DD8452", "#F2B98F"), "S": ("#8172B3", "#B6AEDB"),
            "T": ("#937860", "#C9B29D"), "E": ("#55A868", "#98D1A6"), "G": ("#DA8BC3", "#EDC4E1"),
            "comm": ("#9A9A9A",) * 2}


def _bar_colour(e: TimelineEvent) -> str:
    return _COLOURS[e.kind][max(e.step, 0) % 2]


def plot_gantt(
    events: Iterable[EventLike],
    path: str | os.PathLike,
    *,
    title: str = "",
    xlim: tuple[float, float] | None = None,
    time_unit: str = "s",
) -> None:
    """One row per stage (stage 0 on top): F and B bars, updates as markers, idle as grey background."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes; never opens a window
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    evs = as_events(events)
    stages = sorted({e.stage for e in evs}) or [0]
    end = max((e.end for e in evs), default=1.0)
    fig, ax = plt.subplots(figsize=(min(4 + 0.25 * len(evs) / len(stages), 24), 0.7 * len(stages) + 1.8))
    for s in stages:
        y = len(stages) - 1 - stages.index(s)
        # Everything not covered by a bar is idle: the light background makes the bubble visible.
        ax.broken_barh([(0, end)], (y - 0.4, 0.8), facecolors="#EEEEEE")
        _draw_stage(ax, [e for e in evs if e.stage == s], y)
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in reversed(stages)])
    ax.set_xlabel(f"time [{time_unit}]")
    ax.set_xlim(*(xlim or (0, end)))
    ax.set_title(title)
    legend = [
        Patch(color=_COLOURS["F"][0], label="forward"),
        Patch(color=_COLOURS["B"][0], label="backward"),
        Patch(color=_COLOURS["S"][0], label="vocab shard fwd (S)"),
        Patch(color=_COLOURS["T"][0], label="vocab shard bwd (T)"),
        Patch(color=_COLOURS["E"][0], label="embedding shard fwd (E)"),
        Patch(color=_COLOURS["G"][0], label="embedding shard bwd (G)"),
        Patch(color="#EEEEEE", label="idle"),
        Patch(color="black", label="update start (U0)"),
        Patch(color="#C44E52", label="update (U)"),
        Patch(color=_COLOURS["comm"][0], label="transfer in flight (comm)"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # leave the bottom strip to the legend
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_stage(ax: object, evs: list[TimelineEvent], y: float) -> None:
    bars = [e for e in evs if e.kind in _COLOURS and e.kind != "comm"]
    # Transfers overlap the compute (the distributed optimizer's broadcast of x_{t+1}, the cost model's DP
    # all-reduces): a thin strip along the top of the row, from start to completion.
    comm = [e for e in evs if e.kind == "comm"]
    ax.broken_barh([(e.start, e.duration) for e in comm], (y + 0.4, 0.08), facecolors=_COLOURS["comm"][0])
    ax.broken_barh(
        [(e.start, e.duration) for e in bars],
        (y - 0.4, 0.8),
        facecolors=[_bar_colour(e) for e in bars],
        edgecolor="white",
        linewidth=0.5,
    )
    idle = [e for e in evs if e.kind == "idle"]
    ax.broken_barh(
        [(e.start, e.duration) for e in idle],
        (y - 0.4, 0.8),
        facecolors="none",
        edgecolor="#BBBBBB",
        hatch="//",
        linewidth=0,
    )
    for e in bars:
        if e.kind in ("F", "B", "S", "T", "E", "G") and e.microbatch >= 0:
            ax.text(e.start + e.duration / 2, y, str(e.microbatch), ha="center", va="center", fontsize=6)
    for e in evs:
        if e.kind == "U0":
            ax.plot([e.start, e.start], [y - 0.45, y + 0.45], color="black", linewidth=1.2)
        elif e.kind == "U":
            if e.duration > 0:
                ax.broken_barh([(e.start, e.duration)], (y - 0.4, 0.8), facecolors="#C44E52")
            ax.plot([e.start], [y + 0.47], marker="v", color="#C44E52", markersize=5)


def write_run_timeline(events: Sequence[TimelineEvent], out_dir: str | os.PathLike, title: str, total_steps: int,
                       max_steps: int = 6) -> None:
    """A run's measured events -> timeline.json (Chrome trace) and timeline.png (Gantt of the first
    `max_steps` steps after warm-up)."""
    out = Path(out_dir)
    write_chrome_trace(events, out / "timeline.json")
    first, last = 1, min(total_steps - 1, 1 + max_steps)
    window = [e for e in events if first <= e.step <= last]
    if window:
        plot_gantt(window, out / "timeline.png", title=f"{title}, steps {first}-{last}",
                   xlim=(min(e.start for e in window), max(e.end for e in window)))
