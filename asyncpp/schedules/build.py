"""Schedule generators: (kind, stage, P, m, per-step delays) -> the stage's list[Action]. No torch.

Every kind is built the same way, which keeps them comparable:

1. The steps are cut into *streams*. Synchronous kinds (gpipe, 1f1b, sync) make every step its own
   stream. 2bw and pipedream make each maximal run of consecutive *delayed* steps (d_t > 0) one
   stream, and each synchronous step (d_t == 0: sync start/cooldown) a stream of its own.
2. A stream is the concatenation of its steps' microbatches, k = 0..N-1, ordered 1F1B (GPipe: all
   F, then all B). A stream has one warm-up and one cool-down; between streams the stage flushes.
3. UPDATE_START(t) goes right after the stage's last BACKWARD of b_t.
4. UPDATE(t) goes right after UPDATE_START(t) ("eager"), except for the delayed steps of a lazy kind (2bw), where
   it goes immediately before the first FORWARD on a version >= t+1 ("lazy"), or at the end of the
   list when no such FORWARD exists (on the last stage: before the UPDATE_START that directly precedes
   that FORWARD, so x_{t+1} exists when b_{t+1}'s gradient is taken). Lazy is what makes 2BW bubble-free: the global reductions of
   b_t overlap m-(P-1-s) >= 1 F/B pairs on every stage. Pipedream stays eager on purpose: it
   stashes up to P-s weight versions (the paper's memory profile) instead of deferring d gradient
   buffers, and sync steps are eager because a flush completes the step, its update included.

Every FORWARD/BACKWARD of b_t runs on version max(t - d_t, 0).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from asyncpp.schedules.actions import Action, Op
from asyncpp.schedules.registry import KINDS, kind_of, version_of

__all__ = ["KINDS", "build_pipeline", "build_schedule", "version_of"]


def build_schedule(
    kind: str,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    step_delays: Sequence[int],
    *,
    first_step: int = 0,
    vocab_warmup: int = 0,
) -> list[Action]:
    """The actions of `stage` for len(step_delays) steps; step_delays[i] is its d_t, t = first_step + i.

    first_step > 0 builds a later segment of a run (e.g. after a drain for evaluation) in absolute step
    and version numbers; the segment starts drained, and versions <= first_step count as already produced.
    vocab_warmup: with a vocabulary-parallel head, the F/B skeleton its passes are placed into: every stage warms
    up with this many more forwards, the room the head's chain (broadcast, S on every stage, all-reduce, T, reduce)
    needs between the last stage's F and B of a microbatch. The S and T actions themselves are placed by the cost
    model (asyncpp.schedules.costmodel.place_vocab_passes).
    """
    _validate(kind, stage, num_stages, num_microbatches, step_delays, vocab_warmup > 0)
    delays = {first_step + i: d for i, d in enumerate(step_delays)}
    body: list[Action] = []
    for steps in _streams(kind, delays):
        body.extend(_stream_actions(kind, stage, num_stages, num_microbatches, steps, delays, vocab_warmup))
    return _place_updates(kind, body, delays)


VOCAB_PARALLEL_KINDS = ("sync", "1f1b", "2bw")
"""The kinds a vocabulary-parallel head serves: one weight version per microbatch on every stage (semantics.md:
the shards of one microbatch's logits must be one version; pipedream's per-stage delays break that) and 1F1B
order (GPipe would hold every microbatch's shard logits at once)."""


def check_vocab_parallel(kind: str) -> None:
    """Raise ValueError unless `kind` can run a vocabulary-parallel head (VOCAB_PARALLEL_KINDS)."""
    if kind not in VOCAB_PARALLEL_KINDS:
        raise ValueError(f"a vocabulary-parallel head with schedule={kind}: only {VOCAB_PARALLEL_KINDS} are supported "
                         "(one weight version per microbatch on every stage, 1F1B order); use one of them or keep "
                         "the head on the last stage")


def _validate(kind: str, stage: int, num_stages: int, m: int, step_delays: Sequence[int],
              vocab_parallel: bool = False) -> None:
    k = kind_of(kind)
    k.check(num_stages, m)
    if vocab_parallel:
        check_vocab_parallel(kind)
    allowed = k.allowed_delays(stage, num_stages)
    bad = [(t, d) for t, d in enumerate(step_delays) if d not in allowed]
    if bad:
        t, d = bad[0]
        raise ValueError(
            f"schedule={kind!r} stage={stage} of {num_stages}: step_delays[{t}]={d} is not one of "
            f"{allowed} (0 for synchronous steps, else the steady-state delay of asyncpp.schedules.registry)"
        )


def _streams(kind: str, delays: dict[int, int]) -> Iterator[list[int]]:
    """Consecutive delayed steps share a stream (2bw/pipedream); every other step is its own."""
    run: list[int] = []
    for t, d in delays.items():
        if kind_of(kind).delayed and d > 0:
            run.append(t)
            continue
        if run:
            yield run
            run = []
        yield [t]
    if run:
        yield run


def one_f_one_b(num_items: int, warmup: int) -> Iterator[tuple[Op, int]]:
    """1F1B over items 0..N-1: `warmup` forwards, then F/B pairs, then the remaining backwards."""
    warmup = min(warmup, num_items)
    for k in range(warmup):
        yield Op.FORWARD, k
    for i in range(num_items - warmup):
        yield Op.FORWARD, warmup + i
        yield Op.BACKWARD, i
    for i in range(num_items - warmup, num_items):
        yield Op.BACKWARD, i


def all_f_then_all_b(num_items: int) -> Iterator[tuple[Op, int]]:
    """GPipe: every forward, then every backward (same ascending order, so p2p channels stay FIFO)."""
    for k in range(num_items):
        yield Op.FORWARD, k
    for k in range(num_items):
        yield Op.BACKWARD, k


def _stream_actions(
    kind: str, stage: int, num_stages: int, m: int, steps: list[int], delays: dict[int, int],
    vocab_warmup: int = 0,
) -> list[Action]:
    """F/B of one stream plus UPDATE_START(t) after each step's last backward."""
    n = len(steps) * m
    warmup = num_stages - 1 - stage + vocab_warmup
    order = all_f_then_all_b(n) if kind_of(kind).all_forwards_first else one_f_one_b(n, warmup)

    def action(op: Op, k: int) -> Action:
        t = steps[k // m]
        return Action(op, t, k % m, version_of(t, delays[t]))

    out: list[Action] = []
    for op, k in order:
        t, j = steps[k // m], k % m
        out.append(action(op, k))
        # Backwards run in ascending k, so j == m-1 is the step's last backward on this stage.
        if op is Op.BACKWARD and j == m - 1:
            out.append(Action(Op.UPDATE_START, t))
    return out


def _update_anchors(kind: str, body: list[Action], delays: dict[int, int]) -> list[int]:
    """One anchor per step, in step order: UPDATE(t) goes before body[anchor] (len(body) = at the end)."""
    start_at = {a.step: i for i, a in enumerate(body) if a.op is Op.UPDATE_START}
    anchors: list[int] = []
    for t, d in delays.items():
        anchor = start_at[t] + 1
        if kind_of(kind).lazy_update and d > 0:
            anchor = next(
                (i for i in range(anchor, len(body)) if body[i].op is Op.FORWARD and body[i].version > t),
                len(body),
            )
            # On the last stage that forward directly follows UPDATE_START(t+1); UPDATE(t) goes before it
            # (no work between, so no cost), so that x_{t+1} exists on every stage when b_{t+1}'s gradient
            # is taken: DC-ASGD corrects it with x_{t+1} - x_t there.
            if body[anchor - 1].op is Op.UPDATE_START and body[anchor - 1].step == t + 1:
                anchor -= 1
        # Updates apply in step order: UPDATE(t) builds on x_t, which UPDATE(t-1) wrote.
        anchors.append(max(anchor, anchors[-1]) if anchors else anchor)
    return anchors


def _place_updates(kind: str, body: list[Action], delays: dict[int, int]) -> list[Action]:
    steps, anchors = list(delays), _update_anchors(kind, body, delays)
    out: list[Action] = []
    k = 0
    for i in range(len(body) + 1):
        while k < len(anchors) and anchors[k] == i:
            out.append(Action(Op.UPDATE, steps[k], version=steps[k] + 1))
            k += 1
        if i < len(body):
            out.append(body[i])
    return out


def build_pipeline(
    kind: str, num_stages: int, num_microbatches: int, step_delays: Sequence[Sequence[int]],
    *, vocab_warmup: int = 0,
) -> list[list[Action]]:
    """All stages' schedules; step_delays[s][t] is stage s's delay at step t."""
    if len(step_delays) != num_stages:
        raise ValueError(f"step_delays has {len(step_delays)} rows, expected one per stage ({num_stages})")
    return [build_schedule(kind, s, num_stages, num_microbatches, step_delays[s], vocab_warmup=vocab_warmup)
            for s in range(num_stages)]
