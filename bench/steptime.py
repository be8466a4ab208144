"""The step-time model against every recorded row (bench/recorded/*.json), and what it predicts if Gated DeltaNet ran
as one fused kernel (asyncpp/analysis/steptime.py). Prints two markdown tables, writes JSON.

    .venv/bin/python bench/steptime.py --out bench_results/steptime.json     # ~2-4 min of CPU (meta traces at 4x4096)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncpp.analysis.opcost import DEVICES
from asyncpp.analysis.steptime import (
    GDN_FORMS,
    calibration_rows,
    predict_row,
    time_of,
    trace_workload,
    workload_named,
)
from model_zoo import flops_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/steptime.json")
    args = ap.parse_args()
    cache: dict = {}
    result: dict = {"rows": [], "what_if": []}
    print("| file | workload | backend | measured tok/s | predicted tok/s | predicted / measured | device ms | host ms |")
    print("|---|---|---|---|---|---|---|---|")
    for row in calibration_rows():
        p = predict_row(row, cache)
        t = p.pop("timing")
        print(f"| {row['file']} | {p['workload']} | {p['backend']} | {p['measured_tokens_per_s']:,.0f} | "
              f"{p['predicted_tokens_per_s']:,.0f} | {p['ratio']:.3f} | {t.device_s * 1e3:.1f} | {t.host_s * 1e3:.1f} |")
        result["rows"].append({**p, "device_s": t.device_s, "host_s": t.host_s})
    print("\n| workload | GDN | GPU | ms per microbatch | bound | tok/s | MFU (model FLOPs) | kernels | ops |")
    print("|---|---|---|---|---|---|---|---|---|")
    batch, seq = 4, 4096
    for name in ("smollm2_135m", "hybrid_moe_10b x4"):
        w = workload_named(name)
        model_flops = flops_per_token(w.cfg, seq, w.layers, head=w.whole_model) * batch * seq
        for gdn in GDN_FORMS:
            table = trace_workload(w, "local", batch, seq, gdn=gdn)
            for gpu, device in DEVICES.items():
                t = time_of(table, "microbatch", device)
                mfu = model_flops / t.total_s / device.peak_flops
                print(f"| {name} | {gdn} | {gpu} | {t.total_s * 1e3:.1f} | {t.bound} | {batch * seq / t.total_s:,.0f} | "
                      f"{mfu:.1%} | {t.kernels:.0f} | {t.ops:.0f} |")
                result["what_if"].append({"workload": name, "gdn": gdn, "gpu": gpu, "seconds": t.total_s,
                                          "device_s": t.device_s, "host_s": t.host_s, "mfu": mfu, "kernels": t.kernels,
                                          "ops": t.ops, "top": t.top})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
