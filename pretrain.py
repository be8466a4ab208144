"""asyncpp's entry point: compose the hydra config, validate it, wire the pieces, train.

    python pretrain.py                                  # the embedded default (tiny_hybrid, Muon, 2BW)
    python pretrain.py model=tiny_dense optimizer=adamw schedule=sync train.steps=100
    python pretrain.py staleness.ef_lambda=1.0 parallel.pp=4 schedule=pipedream

This is the only place that reads the environment, starts wandb and touches hydra; everything below
it receives typed, validated objects.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from asyncpp.config import ConfigError, RunConfig
from asyncpp.metrics import MetricsLogger
from asyncpp.optim import build_optimizer
from asyncpp.trainer import Trainer
from model_zoo import ModelConfig, build_model, count_parameters, get_model_config

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def resolve(container: dict) -> tuple[RunConfig, ModelConfig]:
    """Plain dict -> validated (RunConfig, ModelConfig). Raises ConfigError before anything is built."""
    cfg = RunConfig.from_dict(container)
    try:
        model_cfg = get_model_config(cfg.model.name)
    except ValueError as e:
        raise ConfigError(f"model.name: {e}") from None
    return cfg.validate(model_cfg), model_cfg


def compose(overrides: list[str] | None = None) -> dict:
    """The composed config as a plain dict, without running the hydra app (used by tests and tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    overrides = list(overrides or [])
    if not any(o.startswith("out_dir=") for o in overrides):
        overrides.append("out_dir=outputs/compose")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        dcfg = hydra_compose(config_name="pretrain", overrides=overrides)
    return OmegaConf.to_container(dcfg, resolve=True)


def build_data(cfg: RunConfig, model_cfg: ModelConfig):
    from data.source import DefaultDataSource

    source = DefaultDataSource(
        seq_len=cfg.train.seq_len,
        micro_batch_size=cfg.train.micro_batch_size,
        seed=cfg.seed,
        eval_batches=cfg.train.eval_batches,
        val_fraction=cfg.data.val_fraction,
        cache_dir=cfg.data.cache_dir,
    )
    if source.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            f"the tokenizer of data.name={cfg.data.name} has {source.vocab_size} tokens but model "
            f"'{model_cfg.name}' has vocab_size={model_cfg.vocab_size}; pick a model with a vocabulary at "
            "least as large as the tokenizer's"
        )
    return source


def run(cfg: RunConfig, model_cfg: ModelConfig) -> dict:
    """Build everything from a validated config and train. Returns the run summary."""
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.train.device)
    data = build_data(cfg, model_cfg)
    model = build_model(model_cfg, device=device)
    o = cfg.optimizer
    optimizer = build_optimizer(
        model, name=o.name, lr=o.lr, adamw_lr=o.adamw_lr, weight_decay=o.weight_decay, betas=o.betas,
        eps=o.eps, momentum=o.momentum, nesterov=o.nesterov, ns_steps=o.ns_steps, adjust_lr=o.adjust_lr,
    )
    metrics = MetricsLogger(
        cfg.out_dir,
        total_steps=cfg.train.steps,
        config=cfg.to_dict(),
        wandb_mode=cfg.logging.wandb_mode,
        wandb_project=cfg.logging.wandb_project,
        run_name=cfg.logging.run_name,
        progress=cfg.logging.progress,
        log_every=cfg.logging.log_every,
    )
    counts = count_parameters(model_cfg)
    metrics.message(
        f"asyncpp: model={model_cfg.name} ({counts.total / 1e6:.2f}M params, {counts.active / 1e6:.2f}M active) "
        f"optimizer={o.name} schedule={cfg.schedule.name} P={cfg.parallel.pp} "
        f"ef_lambda={cfg.staleness.ef_lambda} m={cfg.train.num_microbatches} "
        f"tokens/step={cfg.train.num_microbatches * cfg.train.micro_batch_size * cfg.train.seq_len} "
        f"out_dir={cfg.out_dir}"
    )
    (Path(cfg.out_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    summary = {}
    try:
        summary = Trainer(cfg, model, optimizer, data, metrics).run()
    finally:
        metrics.close(summary)
    metrics.message("summary: " + json.dumps(summary))
    return summary


@hydra.main(config_path="configs", config_name="pretrain", version_base="1.3")
def main(dcfg: DictConfig) -> float:
    try:
        cfg, model_cfg = resolve(OmegaConf.to_container(dcfg, resolve=True))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    summary = run(cfg, model_cfg)
    return float(summary.get("final_val_loss", float("nan")))  # the value hydra sweepers optimize


if __name__ == "__main__":
    main()
