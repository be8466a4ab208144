"""How many layers each pipeline stage gets: the near-even default, an explicit list, and the cost model's
balanced split. Pure functions of counts and costs; `asyncpp.core.partition` resolves them from a config, and
the vocabulary-parallel head (asyncpp/core/vocab_split.py) sizes its layer split with them."""

from __future__ import annotations

from collections.abc import Sequence

from asyncpp.core.layer_costs import LayerCosts


def default_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage when parallel.stage_layers is not given: as even as possible, the extra layers on
    the first stages (30 layers on 4 stages: [8, 8, 7, 7]). The last stage also runs the final norm, the LM
    head and the loss, so it is the one that should get fewer layers when they cannot all be equal.
    Invariant: sizes differ by at most one and are non-increasing."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} stages (each needs at least one layer); "
                         f"set parallel.pp<={num_layers} or give parallel.stage_layers")
    base, extra = divmod(num_layers, num_stages)
    return [base + 1 if s < extra else base for s in range(num_stages)]


def stage_sizes(num_layers: int, num_stages: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: `sizes` if given (parallel.stage_layers), else `default_split`."""
    if sizes is not None:
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 0:
            raise ValueError(
                f"parallel.stage_layers={list(sizes)} must have parallel.pp={num_stages} non-negative entries "
                f"summing to the model's {num_layers} layers"
            )
        return list(sizes)
    return default_split(num_layers, num_stages)


def balanced_split(costs: LayerCosts, num_stages: int, min_layers: int = 1) -> list[int]:
    """The contiguous split of the layers into `num_stages` stages whose slowest stage is cheapest (the
    embedding's cost on the first stage, the head's and the loss's on the last); among equally slow
    splits, the one with the smallest sum of squared stage costs (so no stage idles for nothing).

    Every stage gets at least `min_layers` layers. 0 would balance a model whose head costs several blocks
    better (a last stage of only the head), but a stage without layers breaks what assumes every stage
    holds some (MoE load statistics ride the norm all-reduce per stage), so `auto` keeps 1; splitting the
    head itself is the way past that limit. Exact dynamic programme over (stages, layers): O(P L^2),
    deterministic, so every rank and the simulator pick the same split without communicating."""
    n = len(costs.layers)
    if not 1 <= num_stages or num_stages * min_layers > n:
        raise ValueError(f"{n} layers cannot give {num_stages} stages {min_layers} layer(s) each; set "
                         f"parallel.pp<={n // max(min_layers, 1)} or give parallel.stage_layers")
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def stage(s: int, lo: int, hi: int) -> float:
        return (prefix[hi] - prefix[lo] + (costs.embedding if s == 0 else 0.0)
                + (costs.head if s == num_stages - 1 else 0.0))

    # best[s][i]: (slowest, sum of squares) of stages 0..s covering layers [0, i); choice[s][i]: stage s's start.
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    choice = [[0] * (n + 1) for _ in range(num_stages)]
    for i in range(min_layers, n + 1):
        c = stage(0, 0, i)
        best[0][i] = (c, c * c)
    for s in range(1, num_stages):
        for i in range(n + 1):
            for j in range(i - min_layers + 1):
                prev = best[s - 1][j]
                c = stage(s, j, i)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[s][i]:
                    best[s][i], choice[s][i] = cand, j
    sizes, end = [], n
    for s in range(num_stages - 1, 0, -1):
        start = choice[s][end]
        sizes.append(end - start)
        end = start
    sizes.append(end)
    return sizes[::-1]
