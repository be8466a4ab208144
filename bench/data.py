"""Data pipeline throughput: tokenization (data.preprocess, 1 and 2 workers) and the loader's time per step.

    .venv/bin/python bench/data.py [--workers 1 2] [--steps 12] [--out bench_results/data.json]

Tokenization writes the embedded corpus (497 documents, 2.8M tokens) through the same path as
`python -m data.preprocess` (texts already in memory, so this is tokenizing + writing, not reading)
and reports tokens/s. The loader part times `train_microbatch` for the m microbatches of one step of
the default run (megatron-core GPTDataset over the default prefix, index caches warm) against one
training step of the default model on the same batches, and prints their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without install

from data.default import DEFAULT_CORPUS, DEFAULT_TOKENIZER, read_corpus, unit_hash
from data.preprocess import write_indexed
from data.tokenizer import load_tokenizer


def tokenization(workers: list[int]) -> list[dict]:
    texts = [d["text"] for d in sorted(read_corpus(DEFAULT_CORPUS), key=lambda d: unit_hash(d["id"]))]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 2**20
    tok = load_tokenizer(DEFAULT_TOKENIZER)
    rows = []
    for w in workers:
        with tempfile.TemporaryDirectory() as tmp:
            stats = write_indexed(lambda skip: iter(texts[skip:]), tok, Path(tmp) / "bench", source={"bench": w},
                                  workers=w, chunk_docs=10**9, progress=False)
            digest = (Path(tmp) / "bench.bin").read_bytes()
        rows.append({"workers": w, "tokens": stats.tokens, "seconds": stats.seconds,
                     "tokens_per_s": stats.tokens / stats.seconds, "mb_per_s": mb / stats.seconds,
                     "bin_bytes": len(digest), "bin_hash": hash(digest)})
    return rows


def loader_vs_step(steps: int, overrides: list[str]) -> dict:
    import torch

    from asyncpp import job
    from asyncpp.optim import build_from_config
    from asyncpp.reference.executor import build_simulator
    from model_zoo import build_model

    cfg, model_cfg = job.resolve(job.compose(["logging=disabled", *overrides]))
    source = job.build_data(cfg, model_cfg)
    m = cfg.train.num_microbatches * (cfg.parallel.dp or 1)
    source.train_microbatch(0)  # builds (or loads) the index caches: a one-off, not per step
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg)
    sim = build_simulator(cfg, model, build_from_config(model, cfg.optimizer))
    load_s, step_s = [], []
    for t in range(steps):
        t0 = time.perf_counter()
        batches = [source.train_microbatch(t * m + j) for j in range(m)]
        t1 = time.perf_counter()
        sim.step(t, batches)
        t2 = time.perf_counter()
        load_s.append(t1 - t0)
        step_s.append(t2 - t1)
    skip = min(3, steps - 1)  # warm-up steps (allocator, first pages of the .bin)
    load, step = sum(load_s[skip:]) / len(load_s[skip:]), sum(step_s[skip:]) / len(step_s[skip:])
    return {"model": model_cfg.name, "microbatches_per_step": m, "micro_batch_size": cfg.train.micro_batch_size,
            "seq_len": cfg.train.seq_len, "loader_s_per_step": load, "train_step_s": step, "ratio": load / step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default="bench_results/data.json")
    p.add_argument("overrides", nargs="*", help="hydra overrides for the loader part, e.g. model=tiny_dense")
    args = p.parse_args(argv)

    tok_rows = tokenization(args.workers)
    if len({r["bin_hash"] for r in tok_rows}) != 1:
        raise SystemExit("the .bin differs between worker counts: order preservation is broken")
    print(f"{'workers':>8} {'tokens':>11} {'seconds':>8} {'tokens/s':>11} {'MB/s':>7}")
    for r in tok_rows:
        print(f"{r['workers']:>8} {r['tokens']:>11,} {r['seconds']:>8.2f} {r['tokens_per_s']:>11,.0f} {r['mb_per_s']:>7.2f}")
    loader = loader_vs_step(args.steps, args.overrides)
    print(f"\nloader: {loader['loader_s_per_step'] * 1e3:.2f} ms/step ({loader['microbatches_per_step']} microbatches of "
          f"{loader['micro_batch_size']}x{loader['seq_len'] + 1} tokens); {loader['model']} step: "
          f"{loader['train_step_s'] * 1e3:.1f} ms; ratio {loader['ratio']:.4f}")
    for r in tok_rows:
        r.pop("bin_hash")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "tokenization": tok_rows, "loader": loader}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
