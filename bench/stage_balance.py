"""What stage balance costs a bubble-free pipeline: the cost model's 2BW step time against the ideal, per split.

For each model and pipeline depth P, the stage costs come from asyncpp.core.layer_costs (forward+backward
FLOP-equivalents per token: layers, the embedding on the first stage, the LM head and the loss on the last)
and feed the schedule simulator (asyncpp.schedules.costmodel, 2BW, m = 4P microbatches, backward = 2 x
forward). The share of the ideal is (total cost / P) per microbatch over the predicted time per microbatch.

- even: Megatron's near-even split (core/partition.default_split);
- auto: parallel.stage_layers=auto (the split minimizing the slowest stage, at least one layer per stage);
- auto + tokens: parallel.head_split=tokens (implemented): stage 0 runs the head and loss of the cost model's
  share of the tokens, the split chosen with it (asyncpp/core/head_split.py), in the schedule with HEAD
  actions (the cost model simulates it; p2p of the token share not costed);
- auto + vocab-parallel head: the head and its loss spread over all P stages (Yeung et al., 2024), the layers
  split by auto without the head. Not implemented in the runtime; an upper bound for it (its all-reduces
  of the softmax statistics and of the head's input gradient are not costed).

    .venv/bin/python bench/stage_balance.py                   # paper models at seq 4096 (CUDA), tiny_dense (CPU)
    .venv/bin/python bench/stage_balance.py --out bench_results/stage_balance.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncpp.core.head_split import plan_head_split
from asyncpp.core.layer_costs import LayerCosts, layer_costs
from asyncpp.core.layer_split import balanced_split, default_split
from asyncpp.schedules.costmodel import OpCosts, predict
from model_zoo import get_model_config

CASES = [  # model, seq_len, micro batch, device type, depths
    ("tiny_dense", 128, 4, "cpu", [2, 4]),
    ("smollm2_135m", 4096, 1, "cuda", [2, 4, 8, 16]),
    ("smollm2_360m", 4096, 1, "cuda", [4, 8, 16]),
    ("moe_2b", 4096, 1, "cuda", [4, 8, 16]),
    ("hybrid_moe_10b", 4096, 1, "cuda", [4, 8, 16]),
]


def share_of_ideal(stage_costs: list[float], P: int) -> float:
    """Ideal time per microbatch (all work spread evenly) over the cost model's 2BW time per microbatch."""
    m = 4 * P
    costs = OpCosts(forward=[c / 3 for c in stage_costs], backward=[2 * c / 3 for c in stage_costs])
    step = predict("2bw", P, m, 12, costs)["step_time"]
    return (sum(stage_costs) / P) / (step / m)


def share_of_ideal_head_split(costs: LayerCosts, P: int, tokens: int) -> tuple[float, list[int], float]:
    """parallel.head_split=tokens at auto: (share of the ideal, the split, the helper's share of the tokens)."""
    plan = plan_head_split(costs, P, tokens)
    x = plan.helper_tokens / tokens
    body = costs.stage_costs(list(plan.sizes))
    body[-1] -= x * costs.head  # the last stage keeps (1 - x) of the head; stage 0's H runs the rest
    ops = OpCosts(forward=[c / 3 for c in body], backward=[2 * c / 3 for c in body], head=x * costs.head)
    m = 4 * P
    step = predict("2bw", P, m, 12, ops, head_split=True)["step_time"]
    total = sum(costs.layers) + costs.embedding + costs.head
    return (total / P) / (step / m), list(plan.sizes), x


def vocab_parallel_costs(costs: LayerCosts, P: int) -> list[float]:
    split = balanced_split(LayerCosts(costs.layers, costs.embedding, 0.0), P)
    return [c + costs.head / P for c in LayerCosts(costs.layers, costs.embedding, 0.0).stage_costs(split)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_results/stage_balance.json")
    args = parser.parse_args()
    rows = []
    for name, seq, mb, device, depths in CASES:
        costs = layer_costs(get_model_config(name), seq, mb, device)
        for P in depths:
            even, auto = default_split(len(costs.layers), P), balanced_split(costs, P)
            tokens_share, tokens_split, helper_share = share_of_ideal_head_split(costs, P, seq * mb)
            rows.append({
                "model": name, "seq_len": seq, "micro_batch": mb, "device": device, "P": P,
                "head_over_mean_layer": costs.head / (sum(costs.layers) / len(costs.layers)),
                "even": even, "auto": auto,
                "share_even": share_of_ideal(costs.stage_costs(even), P),
                "share_auto": share_of_ideal(costs.stage_costs(auto), P),
                "share_head_split_tokens": tokens_share, "head_split_tokens_split": tokens_split,
                "head_split_helper_share": helper_share,
                "share_vocab_parallel": share_of_ideal(vocab_parallel_costs(costs, P), P),
            })
    head = (f"{'model':15} {'seq':>5} {'P':>3} {'head/layer':>10} {'even':>6} {'auto':>6} {'+tokens':>8} {'auto+VP':>8}"
            "  auto split | +tokens split (helper's share)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:15} {r['seq_len']:>5} {r['P']:>3} {r['head_over_mean_layer']:>10.1f} {r['share_even']:>6.2f} "
              f"{r['share_auto']:>6.2f} {r['share_head_split_tokens']:>8.2f} {r['share_vocab_parallel']:>8.2f}  "
              f"{r['auto']} | {r['head_split_tokens_split']} ({r['head_split_helper_share']:.2f})")
    print("\nshare of the ideal throughput predicted for 2BW (m = 4P); +tokens: parallel.head_split=tokens at auto "
          "(stage 0 helps the last stage); auto+VP: the head spread over all stages")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
