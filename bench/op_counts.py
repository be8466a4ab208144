"""ATen ops and kernel-launching ops per layer per microbatch, forward and forward + backward, for each layer kind of
hybrid_moe_10b at its real shapes (B=1, T=4096; GDN H=8, Dk=128, Dv=256; 512 experts top-10; the 131,072-row
head), on the path a GPU runs: meta tensors in bf16 with the GPU's kernels pinned (the MoE experts'
torch._grouped_mm, CUDA's flash attention, the Gated DeltaNet form named in the row; never the CPU-only
fallbacks). An eager GPU step pays roughly 5-15 µs of host time per op (more with autograd), so the op count of a
layer bounds how fast it can run whatever the GPU does.

A row counts every op the dispatcher sees (views included) and, separately, the ops that launch a kernel: every op
but views (an output that aliases an input without writing it), `_unsafe_view` and the allocations (`launches`).
Prints a table and writes <out>/op_counts.json.

    PYTHONPATH=. .venv/bin/python bench/op_counts.py [--seq-len 4096] [--out bench_results]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's asyncpp and data, not bench/data.py

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from asyncpp.analysis.trace import AttentionPath, StandIns, StepTracer
from asyncpp.core.loss import cross_entropy
from model_zoo.attention import Attention
from model_zoo.delta_rule import batched_chunk_gated_delta_rule, chunk_gated_delta_rule
from model_zoo.gated_deltanet import GatedDeltaNet
from model_zoo.layers import RMSNorm
from model_zoo.moe import MoE
from model_zoo.registry import get_model_config

META, BF16 = torch.device("meta"), torch.bfloat16
NO_KERNEL = {"aten::_unsafe_view", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh",
             "aten::detach", "aten::_local_scalar_dense"}
"""Ops that launch no kernel although their output is not a view: metadata, allocations, a scalar read (counted as
a host read by the step's trace, not as a kernel)."""


def launches(func: torch._ops.OpOverload) -> bool:
    """Whether the op launches a kernel on a GPU: it returns a tensor, is not a view (an output aliasing an input it
    does not write: view, transpose, select, expand, split, ...) and is not in NO_KERNEL."""
    returns = func._schema.returns
    if func.name().split(".")[0] in NO_KERNEL or not any("Tensor" in str(r.type) for r in returns):
        return False  # no kernel, or no tensor made at all (aten::promote_types and the like)
    return not all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCounter(StepTracer):
    """A StepTracer (host-read stand-ins on meta, the ops by name) that also keeps which ops launch a kernel."""

    def __init__(self, stand_ins: StandIns):
        super().__init__("meta", stand_ins)
        self.kernels: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if launches(func):
            self.kernels.append(func.name())
        return super().__torch_dispatch__(func, types, args, kwargs)


def count(case: Callable[[], Callable[[], torch.Tensor]], stand_ins: StandIns, backward: bool) -> dict:
    """Ops of the forward `case()` returns (and of its backward when `backward`), by the OpCounter; the inputs
    and the output's cotangent are made outside the count."""
    run = case()
    counter = OpCounter(stand_ins)
    with AttentionPath(gpu=True, tracer=counter), counter:
        out = run()
        if backward:
            with _disable_current_modes():
                cotangent = torch.empty_like(out)
            out.backward(cotangent)
    top = Counter(name.split(".")[0].removeprefix("aten::") for name in counter.kernels).most_common(6)
    return {"ops": len(counter.ops), "kernels": len(counter.kernels), "top_kernels": dict(top)}


def meta_bf16(module: nn.Module) -> nn.Module:
    return module.to(device=META, dtype=BF16)


def delta_rule_case(form: Callable, b: int, t: int, h: int, dk: int, dv: int) -> Callable[[], torch.Tensor]:
    """The delta rule alone, as the layer calls it: fp32 q, k, v, g, beta (the issue's count)."""
    def case() -> Callable[[], torch.Tensor]:
        q, k = (torch.empty(b, t, h, dk, device=META, requires_grad=True) for _ in range(2))
        v = torch.empty(b, t, h, dv, device=META, requires_grad=True)
        g, beta = (torch.empty(b, t, h, device=META, requires_grad=True) for _ in range(2))
        return lambda: form(q, k, v, g, beta, chunk_size=64)[0]
    return case


def layer_case(layer: nn.Module, b: int, t: int, d: int) -> Callable[[], Callable[[], torch.Tensor]]:
    def case() -> Callable[[], torch.Tensor]:
        x = torch.empty(b, t, d, device=META, dtype=BF16, requires_grad=True)
        return lambda: layer(x)
    return case


def head_case(norm: nn.Module, head: nn.Linear, b: int, t: int, d: int) -> Callable[[], Callable[[], torch.Tensor]]:
    """The last stage's head: final norm, the [vocab, d] projection and the fp32 cross entropy."""
    def case() -> Callable[[], torch.Tensor]:
        h = torch.empty(b, t, d, device=META, dtype=BF16, requires_grad=True)
        labels = torch.zeros(b, t, dtype=torch.long, device=META)
        return lambda: cross_entropy(head(norm(h)), labels)
    return case


def cases(b: int, t: int) -> list[tuple[str, str, Callable[[], Callable[[], torch.Tensor]], StandIns]]:
    cfg = get_model_config("hybrid_moe_10b")
    d, gdn, moe_cfg = cfg.hidden_size, cfg.gdn, cfg.moe
    none = StandIns()
    rows = [("gdn delta rule", "chunk loop (CPU default; CUDA before)",
             delta_rule_case(chunk_gated_delta_rule, b, t, gdn.num_heads, gdn.head_k_dim, gdn.head_v_dim), none),
            ("gdn delta rule", "batched (CUDA default without FLA)",
             delta_rule_case(batched_chunk_gated_delta_rule, b, t, gdn.num_heads, gdn.head_k_dim, gdn.head_v_dim),
             none)]
    for kernel, label in (("torch", "chunk loop"), ("batched", "batched")):
        layer = meta_bf16(GatedDeltaNet(d, gdn.num_heads, gdn.head_k_dim, gdn.head_v_dim, conv_size=gdn.conv_size,
                                        norm_eps=cfg.norm_eps, chunk_size=gdn.chunk_size, fla_l2norm=gdn.fla_l2norm))
        layer.kernel = kernel
        rows.append(("gdn layer", label, layer_case(layer, b, t, d), none))
    moe = meta_bf16(MoE(d, moe_cfg))
    moe.pin_kernel(META, BF16, "grouped_mm")  # the H100/H200 choice (asyncpp/analysis/traced.pin_gpu_kernels)
    per_expert = -(-b * t * moe_cfg.top_k // moe_cfg.num_experts)  # a balanced router's rows per expert
    rows.append(("moe layer", "torch._grouped_mm", layer_case(moe, b, t, d),
                 StandIns(ints={"model_zoo/moe.py": per_expert})))
    attention = meta_bf16(Attention(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta,
                                    cfg.max_seq_len, qk_norm=cfg.qk_norm, output_gate=cfg.attn_output_gate,
                                    rotary_dim=cfg.rotary_dim, norm_eps=cfg.norm_eps))
    rows.append(("attention layer", "flash (CUDA)", layer_case(attention, b, t, d), none))
    norm, head = meta_bf16(RMSNorm(d, cfg.norm_eps)), meta_bf16(nn.Linear(d, cfg.vocab_size, bias=False))
    rows.append(("head", f"norm + [{cfg.vocab_size}, {d}] + fp32 cross entropy", head_case(norm, head, b, t, d), none))
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    b, t = args.micro_batch_size, args.seq_len
    rows = []
    print(f"hybrid_moe_10b layers, B={b} T={t}, bf16, meta tensors with the GPU's kernels pinned")
    print(f"{'layer':<16} {'form':<40} {'fwd ops':>8} {'fwd kern':>8} {'f+b ops':>8} {'f+b kern':>8}")
    for layer, form, run, stand_ins in cases(b, t):
        forward, both = count(run, stand_ins, backward=False), count(run, stand_ins, backward=True)
        rows.append({"layer": layer, "form": form, "forward": forward, "forward_backward": both})
        print(f"{layer:<16} {form[:40]:<40} {forward['ops']:>8} {forward['kernels']:>8} {both['ops']:>8} "
              f"{both['kernels']:>8}")
    for r in rows:
        print(f"  {r['layer']} / {r['form']}: top kernels fwd+bwd {r['forward_backward']['top_kernels']}")
    result = {"model": "hybrid_moe_10b", "micro_batch_size": b, "seq_len": t, "dtype": "bf16", "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "op_counts.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'op_counts.json'}")
    return result


if __name__ == "__main__":
    main()
