"""Megatron-LM's command-line flags -> asyncpp's hydra overrides, for a user who knows pretrain_gpt.py's flags.

    python -m launch.megatron_flags --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \\
        --global-batch-size 512 --micro-batch-size 1 --seq-length 4096 --train-iters 1000 --bf16
    python -m launch.megatron_flags --table      # the translation table (docs/launch.md holds this output)

Prints the overrides on one line (paste them after `python -m launch.local ... --` or `launch.slurm ... --`), and
on stderr a note for each flag that has no override of its own (the model's shape is a `model=` choice; unknown
flags are named). The batch follows Megatron: train.global_batch_size with the microbatch count derived per DP
replica (train.batch_scaling=fixed, configs/pretrain.yaml). No torch import: a login node runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    megatron: str
    override: str
    """The override's key, or '' where the flag maps to a note instead."""
    nargs: int = 1
    """Values the flag takes (0: a switch)."""
    value: Callable[[list[str]], str] | None = None
    """Megatron's values -> the override's value; None: the one value as given (a switch: true)."""
    note: str = ""


def _ratio_of_lr(values: list[str], flags: dict[str, list[str]]) -> str:
    lr = float(flags.get("--lr", ["nan"])[0])
    return f"{round(float(values[0]) / lr, 12):g}"


def _list(values: list[str]) -> str:
    return "[" + ",".join(values) + "]"


FLAGS = (
    Flag("--tensor-model-parallel-size", "parallel.tp"),
    Flag("--pipeline-model-parallel-size", "parallel.pp"),
    Flag("--expert-model-parallel-size", "parallel.ep"),
    Flag("--global-batch-size", "train.global_batch_size"),
    Flag("--micro-batch-size", "train.micro_batch_size"),
    Flag("--rampup-batch-size", "train.batch_rampup", 3, _list),
    Flag("--seq-length", "train.seq_len"),
    Flag("--train-iters", "train.steps"),
    Flag("--lr", "optimizer.lr", value=lambda v: f"{float(v[0]):g}"),
    Flag("--min-lr", "optimizer.schedule.min_lr_ratio", note="min-lr / lr (needs --lr)"),
    Flag("--lr-decay-style", "optimizer.schedule.kind", note="cosine, constant or wsd"),
    Flag("--lr-warmup-iters", "optimizer.schedule.warmup_steps"),
    Flag("--weight-decay", "optimizer.weight_decay"),
    Flag("--adam-beta1", "optimizer.betas", note="with --adam-beta2: optimizer.betas=[b1,b2]"),
    Flag("--adam-beta2", "optimizer.betas"),
    Flag("--adam-eps", "optimizer.eps"),
    Flag("--clip-grad", "train.grad_clip"),
    Flag("--bf16", "train.precision", 0, lambda v: "bf16"),
    Flag("--use-distributed-optimizer", "parallel.distributed_optimizer", 0),
    Flag("--sequence-parallel", "parallel.sequence_parallel", 0),
    Flag("--recompute-granularity", "train.recompute", note="full or selective"),
    Flag("--seed", "seed"),
    Flag("--eval-interval", "train.eval_every"),
    Flag("--eval-iters", "train.eval_batches"),
    Flag("--save-interval", "checkpoint.every"),
    Flag("--save", "checkpoint.dir", note="the run directory is otherwise named after the command"),
    Flag("--load", "checkpoint.resume", note="a step_* directory or a run directory (its newest)"),
    Flag("--data-path", "data.blend", -1, _list, note="with data.name=indexed (weights as in Megatron)"),
    Flag("--tokenizer-model", "data.tokenizer"),
    Flag("--log-interval", "logging.log_every"),
)
MODEL_FLAGS = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
               "--num-experts", "--moe-router-topk", "--max-position-embeddings", "--vocab-size")
_BY_NAME = {f.megatron: f for f in FLAGS}


def _split(argv: list[str]) -> dict[str, list[str]]:
    """--flag v1 v2 / --flag=v / --switch -> {flag: values}, in order."""
    out: dict[str, list[str]] = {}
    key = None
    for arg in argv:
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            out[key] = [value] if eq else []
        elif key is not None:
            out[key].append(arg)
    return out


def translate(argv: list[str]) -> tuple[list[str], list[str]]:
    """Megatron flags -> (overrides, notes). Notes name the flags with no override (model shape, unknown ones)."""
    flags = _split(argv)
    overrides: list[str] = []
    notes: list[str] = []
    for name, values in flags.items():
        flag = _BY_NAME.get(name)
        if name in MODEL_FLAGS:
            notes.append(f"{name}: the model's shape is a model= choice (configs/model/, model_zoo/registry.py) or "
                         f"model.overrides; not translated")
        elif flag is None:
            notes.append(f"{name}: not known to this table; look for it in asyncpp's config (python pretrain.py "
                         "--cfg job)")
        elif name == "--adam-beta2":
            continue  # folded into --adam-beta1's optimizer.betas
        elif flag.nargs >= 0 and len(values) != flag.nargs:
            notes.append(f"{name}: expects {flag.nargs} value(s), got {values}")
        else:
            overrides.append(f"{flag.override}={_value(flag, values, flags)}")
    return overrides, notes


def _value(flag: Flag, values: list[str], flags: dict[str, list[str]]) -> str:
    if flag.megatron == "--min-lr":
        return _ratio_of_lr(values, flags)
    if flag.megatron == "--adam-beta1":
        return f"[{values[0]},{flags.get('--adam-beta2', ['0.95'])[0]}]"
    if flag.value is not None:
        return flag.value(values)
    return values[0] if flag.nargs else "true"


def table() -> str:
    """The translation table as markdown (docs/launch.md holds it; tests/unit/test_global_batch.py compares)."""
    rows = ["| Megatron-LM flag | asyncpp override | note |", "|---|---|---|"]
    rows += [f"| `{f.megatron}` | `{f.override}` | {f.note} |" for f in FLAGS]
    rows += [f"| `{name}` | `model=...` | the model's shape: a config in configs/model/ |" for name in MODEL_FLAGS]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in ([], ["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if argv == ["--table"]:
        print(table())
        return 0
    overrides, notes = translate(argv)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(" ".join(overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
