"""What stage balance costs a bubble-free pipeline: the cost model's 2BW step time against the ideal, per split.

For each model and pipeline depth P, the stage costs come from asyncpp.core.layer_costs (forward+backward
FLOP-equivalents per token: layers, the embedding on the first stage, the LM head and the loss on the last)
and feed the schedule simulator (asyncpp.schedules.costmodel, 2BW, m = 4P microbatches, backward = 2 x
forward). The share of the ideal is (total cost / P) per microbatch over the predicted time per microbatch.

- even: Megatron's near-even split (core/partition.default_split);
- auto: parallel.stage_layers=auto (the split minimizing the slowest stage, at least one layer per stage);
- VP bound: the head and its loss spread evenly over all P stages (Yeung et al., 2024), the layers split by auto
  without the head; no communication. The upper bound the issue quoted.
- VP costed (asyncpp/core/vocab_split.py): the layer split and unequal vocabulary shards chosen together, plus
  the broadcast of the hidden states, the statistics' all-reduces and the input gradient's reduce, at a stated
  link (nvlink: 360 GB/s bus bandwidth, 10 us per collective; ib: 50 GB/s, 25 us) and the device's FLOP rate
  (layer_costs.FLOP_RATE: H100 at 40% MFU), bf16 on the wire. "exposed": the collectives add to every stage's
  time (blocking, on the compute stream); "hidden": they run beside the compute (Yeung et al.'s placement of the
  head's passes; each stage bounded by max(compute, link time)). "ib sim": the head's passes as S and T actions
  in the 2BW schedule, placed by the cost model (asyncpp/schedules/costmodel.place_vocab_passes), the collectives as
  latencies on the edges they carry, at ib; bounded also by the link's occupancy. "+emb": the same with the input
  embedding sharded by the head's rows too (parallel.embedding=vocab; costmodel.place_embedding_passes places its
  E and G actions, its reduce and broadcast at ib, their bytes on the link). "ib sim blk": the same, the
  collectives blocking (S and T occupy the stage for them too). The engine runs them with parallel.head=vocab (pipeline/vocab_head.py).

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

from asyncpp.core.layer_costs import LayerCosts, layer_costs
from asyncpp.core.layer_split import balanced_split, default_split
from asyncpp.core.vocab_split import LINKS, comm_per_token, plan_vocab_split, vocab_comm_time
from asyncpp.schedules.costmodel import OpCosts, predict
from model_zoo import get_model_config

CASES = [  # model, seq_len, micro batch, device type, depths
    ("tiny_dense", 128, 4, "cpu", [2, 4]),
    ("smollm2_135m", 4096, 1, "cuda", [2, 4, 8, 16]),
    ("smollm2_360m", 4096, 1, "cuda", [4, 8, 16]),
    ("moe_2b", 4096, 1, "cuda", [2, 4, 8, 16]),
    ("hybrid_moe_10b", 4096, 1, "cuda", [2, 4, 8, 16]),
]
VP_COLUMNS = (("nvlink", "exposed"), ("ib", "exposed"), ("ib", "hidden"))
"""(link, overlap) of each costed vocabulary-parallel column."""


def share_of_ideal(stage_costs: list[float], P: int, total: float | None = None) -> float:
    """Ideal time per microbatch (all of `total`'s work, default the stages' sum, spread evenly) over the cost
    model's 2BW time per microbatch. `total` is the compute alone when stage_costs include communication."""
    m = 4 * P
    costs = OpCosts(forward=[c / 3 for c in stage_costs], backward=[2 * c / 3 for c in stage_costs])
    step = predict("2bw", P, m, 12, costs)["step_time"]
    return ((sum(stage_costs) if total is None else total) / P) / (step / m)


def vocab_parallel_costs(costs: LayerCosts, P: int) -> list[float]:
    split = balanced_split(LayerCosts(costs.layers, costs.embedding, 0.0), P)
    return [c + costs.head / P for c in LayerCosts(costs.layers, costs.embedding, 0.0).stage_costs(split)]


def vocab_parallel_costed(costs: LayerCosts, model, P: int, tokens: int, device: str, link: str, overlap: str,
                          equal_shards: bool = False) -> dict:
    """The costed vocabulary-parallel head at one (link, overlap): share of the ideal, the split, the shards."""
    comm = vocab_comm_time(tokens, model.hidden_size, P, LINKS[link])
    plan = plan_vocab_split(costs, P, model.vocab_size, comm=comm_per_token(comm, tokens, device), overlap=overlap,
                            equal_shards=equal_shards)
    total = sum(costs.layers) + costs.embedding + costs.head
    return {"share": share_of_ideal(plan.stage_costs, P, total), "split": list(plan.sizes),
            "shards": list(plan.shards), "comm_s_per_microbatch": comm.total,
            "comm_over_stage_compute": plan.comm / max(plan.compute)}


def vocab_parallel_simulated(costs: LayerCosts, model, P: int, tokens: int, device: str, link: str,
                             blocking: bool = False, embedding: bool = False) -> dict:
    """The head's S and T as actions in the 2BW schedule (costmodel.place_vocab_passes), its collectives as
    latencies on their own stream at `link`: the simulated share of the ideal, bounded also by the link's
    occupancy (each stage's link carries the head's bytes of every microbatch). blocking: the collectives occupy
    the stage too (S takes the broadcast and the statistics' all-reduces longer, T the reduce), as a blocking
    implementation on the compute stream would. embedding: the input embedding sharded by the same rows
    (parallel.embedding=vocab), its E and G actions placed too (costmodel.place_embedding_passes), its reduce and
    broadcast latencies at `link` and their bytes on the link."""
    comm = vocab_comm_time(tokens, model.hidden_size, P, LINKS[link], embedding=embedding)
    unit = comm_per_token(comm, tokens, device) / comm.total  # cost-model units per second
    plan = plan_vocab_split(costs, P, model.vocab_size, embedding=embedding)
    embed = plan.embed or (0.0,) * P
    body = [c - h - e for c, h, e in zip(plan.compute, plan.head, embed)]
    held_s = (comm.broadcast + comm.statistics) * unit if blocking else 0.0
    held_t = comm.gradient * unit if blocking else 0.0
    ops = OpCosts(forward=[b / 3 for b in body], backward=[2 * b / 3 for b in body],
                  vocab_forward=[h / 3 + held_s for h in plan.head],
                  vocab_backward=[2 * h / 3 + held_t for h in plan.head],
                  vocab_broadcast=comm.broadcast * unit, vocab_allreduce=comm.statistics * unit,
                  vocab_reduce=comm.gradient * unit, embed_forward=plan.embed_lookup,
                  embed_backward=[e - plan.embed_lookup for e in embed], embed_reduce=comm.embedding / 2 * unit,
                  embed_broadcast=comm.embedding / 2 * unit)
    m = 4 * P
    r = predict("2bw", P, m, 6, ops, collective_updates=True, vocab_parallel=True, sharded_embedding=embedding)
    per_microbatch = max(r["step_time"] / m, comm.total * unit)
    total = sum(costs.layers) + costs.embedding + costs.head  # the unsplit model's work: what the ideal spreads
    return {"share": (total / P) / per_microbatch, "bubble": r["bubble"], "vocab_warmup": r["vocab_warmup"],
            "peak_activations": r["peak_activations"], "split": list(plan.sizes), "shards": list(plan.shards)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_results/stage_balance.json")
    args = parser.parse_args()
    rows = []
    for name, seq, mb, device, depths in CASES:
        costs = layer_costs(get_model_config(name), seq, mb, device)
        for P in depths:
            even, auto = default_split(len(costs.layers), P), balanced_split(costs, P)
            rows.append({
                "model": name, "seq_len": seq, "micro_batch": mb, "device": device, "P": P,
                "head_over_mean_layer": costs.head / (sum(costs.layers) / len(costs.layers)),
                "even": even, "auto": auto,
                "share_even": share_of_ideal(costs.stage_costs(even), P),
                "share_auto": share_of_ideal(costs.stage_costs(auto), P),
                "share_vocab_parallel": share_of_ideal(vocab_parallel_costs(costs, P), P),
            })
            model = get_model_config(name)
            for link, overlap in VP_COLUMNS:
                vp = vocab_parallel_costed(costs, model, P, seq * mb, device, link, overlap)
                rows[-1][f"vp_{link}_{overlap}"] = vp
            rows[-1]["vp_ib_simulated"] = vocab_parallel_simulated(costs, model, P, seq * mb, device, "ib")
            rows[-1]["vp_ib_simulated_embedding"] = vocab_parallel_simulated(costs, model, P, seq * mb, device, "ib",
                                                                             embedding=True)
            rows[-1]["vp_ib_simulated_blocking"] = vocab_parallel_simulated(costs, model, P, seq * mb, device, "ib",
                                                                            blocking=True)
            rows[-1]["vp_ib_exposed_equal_shards"] = vocab_parallel_costed(costs, model, P, seq * mb, device,
                                                                           "ib", "exposed", equal_shards=True)
    head = (f"{'model':15} {'seq':>5} {'P':>3} {'head/layer':>10} {'even':>6} {'auto':>6} {'VP bound':>9}"
            f" {'VP nvl':>7} {'VP ib':>6} {'VP ib hid':>9} {'ib sim':>6} {'+emb':>5} {'ib sim blk':>10} {'ib equal':>8}  auto split")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:15} {r['seq_len']:>5} {r['P']:>3} {r['head_over_mean_layer']:>10.1f} {r['share_even']:>6.2f} "
              f"{r['share_auto']:>6.2f} {r['share_vocab_parallel']:>9.2f} "
              f"{r['vp_nvlink_exposed']['share']:>7.2f} {r['vp_ib_exposed']['share']:>6.2f} "
              f"{r['vp_ib_hidden']['share']:>9.2f} {r['vp_ib_simulated']['share']:>6.2f} "
              f"{r['vp_ib_simulated_embedding']['share']:>5.2f} "
              f"{r['vp_ib_simulated_blocking']['share']:>10.2f} "
              f"{r['vp_ib_exposed_equal_shards']['share']:>8.2f}  "
              f"{r['auto']}")
    print("\nshare of the ideal throughput predicted for 2BW (m = 4P); VP bound: the head spread evenly over all stages, no communication; "
          "VP nvl / VP ib: layers and unequal vocabulary shards chosen together, the head's collectives exposed at "
          f"{LINKS['nvlink'].bandwidth / 1e9:g} / {LINKS['ib'].bandwidth / 1e9:g} GB/s; VP ib hid: hidden beside "
          "the compute (link-bound); ib sim: the head's S and T as actions in the 2BW schedule, its collectives as "
          "latencies at ib (costmodel.place_vocab_passes); +emb: the same with the input embedding sharded by the "
          "head's rows (parallel.embedding=vocab: E and G actions, their reduce and broadcast at ib); ib sim blk: the same with blocking collectives (they "
          "occupy the stage); ib equal: equal shards, exposed at ib")
    for r in rows:
        vp = r["vp_ib_exposed"]
        print(f"  {r['model']} P={r['P']}: VP split {vp['split']}, shards {vp['shards']}, comm "
              f"{vp['comm_s_per_microbatch'] * 1e3:.3f} ms/microbatch at ib = {vp['comm_over_stage_compute']:.2f} "
              f"of the slowest stage's compute; simulated: bubble {r['vp_ib_simulated']['bubble']:.3f}, "
              f"{r['vp_ib_simulated']['vocab_warmup']} more warm-up forward(s), peak activations "
              f"{r['vp_ib_simulated']['peak_activations']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
