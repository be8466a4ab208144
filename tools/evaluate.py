"""Downstream evaluation of a training checkpoint with lm-evaluation-harness (`pip install lm-eval`).

    python -m tools.evaluate --checkpoint outputs/study/muon__sync__seed1 --tasks local
    python -m tools.evaluate --checkpoint <run>/checkpoints/step_00000600 --tasks paper --out results.json
    python -m tools.evaluate --checkpoint <run> --tasks asyncpp_pydoc_cloze,hellaswag --limit 100

`AsyncppLM` adapts our CausalLM and the run's tokenizer to lm-eval's `LM` interface (loglikelihood and
loglikelihood_rolling; generation is not needed by the paper's Table 4 tasks). `--tasks local` runs the
offline tasks shipped in data/eval/tasks/ (no network); `--tasks paper` the Table 4 list in
data/eval/paper_tasks.yaml, whose data comes from the Hugging Face hub. Where the hub cannot be reached (or
HF_DATASETS_OFFLINE is set) and the data is not cached, the run stops with an error that lists the datasets
those tasks read and how to pre-download them (evaluate(), offline_message()).

Scoring follows lm-eval's HF backend: the continuation's tokens are those of `encode(context +
continuation)` after the context's (so a BPE merge across the boundary is scored as the model sees it),
trailing spaces of the context move to the continuation, and an empty context is replaced by the
end-of-document token the model was trained with.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

try:
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # an optional extra: say how to get it instead of a bare traceback
    raise ImportError(f"tools.evaluate needs lm-evaluation-harness ({e}); install it with "
                      "`.venv/bin/pip install -e '.[eval]'` (or `pip install lm-eval`)") from e
from torch import nn

EVAL_DIR = Path(__file__).resolve().parent.parent / "data" / "eval"
TASKS_DIR = EVAL_DIR / "tasks"
TASK_LISTS = EVAL_DIR / "paper_tasks.yaml"


class EvaluateError(ValueError):
    """A checkpoint, tokenizer or task cannot be used; the message names which and the fix."""


class AsyncppLM(LM):
    """lm-eval's LM over a model_zoo CausalLM (`model(tokens [B, T]) -> logits [B, T, V]`)."""

    def __init__(self, model: nn.Module, tokenizer, eod_id: int, max_length: int, batch_size: int = 8,
                 device: str = "cpu"):
        super().__init__()
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.eod_id = eod_id
        self.max_length = max_length
        self.batch_size = batch_size
        self._device = torch.device(device)  # LM.device is a read-only property over _device

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens) as lm-eval's HF backend splits them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        cont = whole[len(ctx):]
        return (ctx or [self.eod_id]), cont

    @torch.no_grad()
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether every continuation token is the argmax) per pair.

        Inputs longer than max_length keep their last max_length tokens. Batched with right padding: a
        causal model's logits at a position do not depend on what follows it.
        """
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            inputs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1):][:-1] for i in idx]
            width = max(len(x) for x in inputs)
            batch = torch.full((len(idx), width), self.eod_id, dtype=torch.long)
            for row, x in enumerate(inputs):
                batch[row, :len(x)] = torch.tensor(x)
            logprobs = F.log_softmax(self.model(batch.to(self.device)).float(), dim=-1)
            for row, i in enumerate(idx):
                cont = pairs[i][1]
                n = len(inputs[row])
                lp = logprobs[row, n - len(cont):n]  # positions that predict the continuation's tokens
                target = torch.tensor(cont, device=lp.device)
                out[i] = (lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all()))
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*r.args) for r in requests]
        empty = [r.args for r, (_, cont) in zip(requests, pairs) if not cont]
        if empty:
            raise EvaluateError(f"continuation {empty[0][1]!r} of context {empty[0][0][-40:]!r} has no tokens")
        return self.score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        results = []
        for r in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(r.args[0]), prefix_token=self.eod_id, max_seq_len=self.max_length,
                context_len=1)]
            results.append(sum(lp for lp, _ in self.score(windows)))
        return results

    def generate_until(self, requests) -> list[str]:
        raise NotImplementedError(
            "tools.evaluate scores log-likelihoods only (the paper's Table 4 tasks are multiple choice); a "
            "generation task needs a sampler: export the checkpoint with `python -m tools.hf export` and use "
            "lm-eval's hf backend")


# ---- checkpoints and tasks ----------------------------------------------------------------------------


def checkpoint_dir(path: str | Path) -> Path:
    """A step_* checkpoint, or a run directory (its newest checkpoint)."""
    path = Path(path)
    if path.name.startswith("step_"):
        return path
    steps = sorted((path / "checkpoints").glob("step_*")) if (path / "checkpoints").is_dir() else []
    if not steps:
        raise EvaluateError(f"--checkpoint {path}: neither a step_* checkpoint nor a run directory with "
                            "checkpoints/step_*; train with checkpoint.enabled=true")
    return steps[-1]


def load_tokenizer_for(run_config: dict, override: str | None = None):
    """The tokenizer the run trained with: the default corpus' own, data.tokenizer, or the prefix's record."""
    from data.default import DEFAULT_TOKENIZER
    from data.tokenizer import load_tokenizer

    data = run_config["data"]
    spec = override or (str(DEFAULT_TOKENIZER) if data["name"] == "default" else data.get("tokenizer"))
    if spec is None:
        from asyncpp.config import parse_blend
        from data.source import resolve_tokenizer

        prefixes, _ = parse_blend(data["blend"])
        _, spec = resolve_tokenizer(prefixes, None)
    return load_tokenizer(spec)


def load_lm(checkpoint: str | Path, batch_size: int = 8, device: str = "cpu", tokenizer: str | None = None) -> AsyncppLM:
    from asyncpp.train.checkpoint import read_manifest
    from tools.hf import build_from_state_dict, load_checkpoint_weights

    path = checkpoint_dir(checkpoint)
    state, model_cfg = load_checkpoint_weights(path)
    tok = load_tokenizer_for(read_manifest(path)["config"], tokenizer)
    if tok.vocab_size > model_cfg.vocab_size:
        raise EvaluateError(f"tokenizer {tok.name} has {tok.vocab_size} tokens, model {model_cfg.name} only "
                            f"{model_cfg.vocab_size}; pass the run's tokenizer with --tokenizer")
    model = build_from_state_dict({k: v.float() for k, v in state.items()}, model_cfg)
    return AsyncppLM(model, tok.tokenizer, tok.eod_id, model_cfg.max_seq_len, batch_size, device)


def task_specs(names: Iterable[str]) -> list[str | dict]:
    """Task names for lm-eval: `local` and `paper` expand to data/eval/paper_tasks.yaml's lists; a name with a
    YAML in data/eval/tasks/ becomes its config with the data file made absolute (so any cwd works)."""
    lists = yaml.safe_load(TASK_LISTS.read_text())
    specs: list[str | dict] = []
    for name in names:
        for task in lists["local"] if name == "local" else lists["tasks"] if name == "paper" else [name]:
            path = TASKS_DIR / f"{task}.yaml"
            if not path.is_file():
                specs.append(task)  # an lm-eval task name; lm-eval says so if it does not exist
                continue
            spec = yaml.safe_load(path.read_text())
            files = spec["dataset_kwargs"]["data_files"]
            spec["dataset_kwargs"]["data_files"] = {k: str((path.parent / v).resolve()) for k, v in files.items()}
            specs.append(spec)
    return specs


def evaluate(lm: AsyncppLM, tasks: list[str], limit: int | None = None, num_fewshot: int | None = None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    specs = task_specs(tasks)
    # Indexing lm-eval's thousands of built-in task YAMLs takes seconds; local tasks arrive as configs.
    manager = TaskManager(include_defaults=any(isinstance(s, str) for s in specs))
    try:
        return simple_evaluate(model=lm, tasks=specs, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                               bootstrap_iters=0, log_samples=False)
    except Exception as e:  # only a failure to reach the hub is translated; anything else propagates as is
        offline = offline_cause(e)
        if offline is None:
            raise
        names = [s for s in specs if isinstance(s, str)]
        raise EvaluateError(offline_message(names, hub_datasets(manager.task_index, names), offline)) from e


# ---- hub tasks without network ------------------------------------------------------------------------

# What datasets / huggingface_hub / requests / httpx raise when the hub cannot be reached, or is switched off
# (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE) and the data is not cached. Matched by name along the exception chain:
# these libraries wrap each other's errors, and importing each to isinstance-check would import them all.
_OFFLINE_ERRORS = {"ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "ProxyError",
                   "OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError", "gaierror"}


def offline_cause(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain that says the hub was unreachable (or offline mode hid it), or None."""
    seen: set[int] = set()
    node: BaseException | None = error
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if type(node).__name__ in _OFFLINE_ERRORS or isinstance(node, ConnectionError):
            return node
        node = node.__cause__ or node.__context__
    return None


def hub_datasets(index: dict, names: Iterable[str]) -> dict[str, set[str]]:
    """Hugging Face dataset id -> its configs (dataset_name; "" for the default) that lm-eval's tasks `names`
    (tasks, groups or tags) read, from lm-eval's task index (no network)."""
    from lm_eval.tasks._index import Kind

    found: dict[str, set[str]] = {}
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        entry = index.get(name) if isinstance(name, str) else None
        if entry is None or name in seen:
            continue
        seen.add(name)
        cfg = dict(entry.cfg or {})
        if "dataset_path" not in cfg and cfg.get("include") and entry.yaml_path is not None:
            included = Path(entry.yaml_path).parent / cfg["include"]  # a template holds the dataset
            if included.is_file():
                base = yaml.load(included.read_text(), Loader=_IgnoreTags)
                cfg = {**(base or {}), **cfg}
        if cfg.get("dataset_path"):
            found.setdefault(cfg["dataset_path"], set()).add(cfg.get("dataset_name") or "")
        children = cfg.get("task") if entry.kind == Kind.GROUP else None
        for child in children if isinstance(children, list) else []:
            todo.append(child.get("task") if isinstance(child, dict) else child)
        if entry.kind == Kind.TAG:
            todo += [n for n, e in index.items() if name in (e.tags or ())]
    return found


class _IgnoreTags(yaml.SafeLoader):
    """lm-eval templates use `!function module.fn`; reading their dataset fields needs none of those."""


_IgnoreTags.add_multi_constructor("!", lambda loader, suffix, node: None)


def offline_message(tasks: list[str], datasets: dict[str, set[str]], cause: BaseException) -> str:
    from datasets import config as ds_config

    first = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else ""
    listed = "; ".join(f"{path} ({', '.join(sorted(c for c in configs if c)) or 'default'})"
                       if len(configs) <= 4 else f"{path} ({len(configs)} configs)"
                       for path, configs in sorted(datasets.items()))
    downloads = "\n".join(f"    huggingface-cli download --repo-type dataset {path}" for path in sorted(datasets))
    return (
        f"tasks {', '.join(tasks)} read their data from the Hugging Face hub, which this machine cannot reach "
        f"({type(cause).__name__}: {first}).\n"
        f"They need these datasets: {listed or '(lm-eval names none; see its task YAMLs)'}.\n"
        "Pre-download them where the hub is reachable, into the cache this machine reads "
        f"(HF_HOME, now {ds_config.HF_CACHE_HOME}; copy it over if that is another machine):\n"
        f"{downloads}\n"
        "  (or run this same command there once: lm-eval's first run fills the cache), then run here with "
        "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 so nothing tries the network. `--tasks local` needs no network."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a step_* checkpoint or a run directory (newest checkpoint)")
    p.add_argument("--tasks", default="local", help="comma-separated lm-eval task names, `local` or `paper`")
    p.add_argument("--limit", type=int, default=None, help="at most this many documents per task")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or hub name (default: the run's)")
    p.add_argument("--out", type=Path, default=None, help="write lm-eval's results here as JSON")
    args = p.parse_args(argv)
    try:
        lm = load_lm(args.checkpoint, args.batch_size, args.device, args.tokenizer)
        results = evaluate(lm, [t for t in args.tasks.split(",") if t], args.limit, args.num_fewshot)
    except (EvaluateError, FileNotFoundError) as e:
        print(f"evaluate error: {e}", file=sys.stderr)
        return 2
    table = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
             for task, metrics in results["results"].items()}
    print(json.dumps(table, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps({"checkpoint": str(checkpoint_dir(args.checkpoint)), "results": table,
                                        "config": results.get("config", {})}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
