"""One training job, built from a composed config: what `pretrain.py` runs, and what tests, tools, bench and the
launchers import (nothing imports pretrain.py itself).

    compose(overrides) -> dict -> resolve -> (RunConfig, ModelConfig)   validated, before anything exists
    run(cfg, model_cfg)              one process: the single-process simulator of the schedule
    run_distributed(cfg, model_cfg)  under torchrun: one pipeline stage per rank
    run_dry(cfg, model_cfg)          dry_run=N: the layout at N ranks on a fake process group

The composition root: the one module that wires data, model, optimizer, executor, trainer and metrics together.
Everything it calls receives typed, validated objects; the environment's signals, hydra's app and the exit codes
stay in pretrain.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncpp.analysis.dryrun import dry_run
from asyncpp.analysis.opcost import CostTracer
from asyncpp.analysis.stagetime import prediction_report
from asyncpp.analysis.traced import TRACED_STEPS, trace_stage
from asyncpp.config import ConfigError, RunConfig, check_pipeline_options, parse_blend
from asyncpp.config.parallel import TOKEN_SPLIT_REMOVED
from asyncpp.core.batches import BatchPlan
from asyncpp.core.memory import simulator_run_report
from asyncpp.core.partition import check_stages_hold_weights, with_head_resolved
from asyncpp.core.update import NonFiniteUpdate
from asyncpp.host.measured import host_rss_bytes
from asyncpp.optim import build_from_config
from asyncpp.parallel import failfast, flight
from asyncpp.parallel.mesh import Mesh, ParallelDims, init_distributed
from asyncpp.pipeline.build import build_rank_stage, build_whole_model, mesh_for
from asyncpp.pipeline.compose import pipeline_executor
from asyncpp.pipeline.executor import PipelineExecutor
from asyncpp.pipeline.p2p import naming_the_peer
from asyncpp.reference.executor import ReferenceExecutor
from asyncpp.train import preflight
from asyncpp.train.checkpoint import resume_target
from asyncpp.train.metrics import MetricsLogger
from asyncpp.train.preemption import StopFlag
from asyncpp.train.run_identity import register_resolvers
from asyncpp.train.throughput import Throughput, device_peak_tflops
from asyncpp.train.timeline import write_run_timeline
from asyncpp.train.trainer import Trainer, TrainingAborted
from asyncpp.typed import check_partial
from data.default import default_cache_dir, default_prefix
from data.indexed import IndexedDataError
from data.source import IndexedDataSource
from model_zoo import ModelConfig, count_parameters, flops_per_token, get_model_config
from model_zoo.backends import prepare_model

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
register_resolvers()  # the run directory's name (configs/pretrain.yaml), before hydra composes anything


def resolve(container: dict, world_size: int = 1) -> tuple[RunConfig, ModelConfig]:
    """Plain dict -> validated (RunConfig, ModelConfig). Raises ConfigError before anything is built.

    world_size > 1 (torchrun, a launcher checking a job it is about to submit, dry_run=N): parallel.dp is derived
    from it first, so what depends on dp (train.global_batch_size's microbatch count) is checked at the
    real layout, still before any process group exists."""
    cfg = RunConfig.from_dict(container)
    resume = resume_target(cfg.checkpoint.resume)  # a run directory as printed -> its newest checkpoint
    cfg = cfg.replace(checkpoint=dataclasses.replace(cfg.checkpoint, resume=resume))
    overrides = check_partial(ModelConfig, cfg.model.overrides or {}, "model.overrides")  # types, before values
    try:
        model_cfg = get_model_config(cfg.model.name, **overrides)
    except ValueError as e:
        raise ConfigError(f"model.overrides: {e}" if cfg.model.overrides else f"model.name: {e}") from None
    ranks = cfg.dry_run or world_size  # dry_run=N lays the job out at N ranks
    if ranks > 1:
        p = cfg.parallel
        dims = ParallelDims.for_world(ranks, pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
        cfg = cfg.replace(parallel=dataclasses.replace(p, dp=dims.dp))
    cfg = cfg.validate(model_cfg)
    if ranks > 1:  # what a multi-process pipeline cannot run: refused for a dry run and a launcher's check too
        check_pipeline_options(cfg, model_cfg)
        check_stages_hold_weights(cfg, model_cfg)
    return with_head_resolved(cfg, model_cfg), model_cfg


#: Overrides whose value is a path that may be a run directory's name, which holds '=' and ',' (hydra's syntax).
PATH_KEYS = ("checkpoint.resume", "checkpoint.dir", "out_dir", "hydra.run.dir")


def quote_paths(overrides: list[str]) -> list[str]:
    """`checkpoint.resume=outputs/model=x,train.steps=4` as printed -> the quoted form hydra parses as one value
    (`checkpoint.resume='outputs/model=x,train.steps=4'`); a quoted value, or one without '=' ',' or a space, as is."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        needs = any(ch in value for ch in "=, ") and value[:1] not in ("'", '"') and "'" not in value
        out.append(f"{key}='{value}'" if eq and key.lstrip("+~") in PATH_KEYS and needs else o)
    return out


def compose(overrides: list[str] | None = None) -> dict:
    """The composed config as a plain dict, without running the hydra app (used by tests and tools)."""
    overrides = quote_paths(list(overrides or []))
    if not any(o.startswith("out_dir=") for o in overrides):
        overrides.append("out_dir=outputs/compose")
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            dcfg = hydra_compose(config_name="pretrain", overrides=overrides)
        return to_container(dcfg)
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as e:  # hydra's parser raises plain ValueErrors too
        raise ConfigError(composition_error(e, overrides)) from None


def to_container(dcfg) -> dict:
    """The composed DictConfig as a plain dict, its ${...} interpolations resolved; a bad interpolation is a
    ConfigError naming the key (pretrain.py's hydra app and compose() both go through here)."""
    try:
        return OmegaConf.to_container(dcfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "an override"
        raise ConfigError(f"{key}: {_first_line(e)}; an interpolation ${{...}} must name an existing key (e.g. "
                          "optimizer.ademamix_warmup_steps=${train.steps}) or a registered resolver; quote a "
                          "literal value that contains '${'") from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _config_keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out += _config_keys(value, path + ".") if isinstance(value, dict) else [path]
    return out


RENAMED = {"parallel.head_split": "the head's placement is one key now: parallel.head=last, vocab or auto (the "
                                  "token head split parallel.head_split=tokens was removed: use vocab)",
           "parallel.head_split_tokens": f"it set the token head split's share; {TOKEN_SPLIT_REMOVED}"}
"""Keys a release renamed or removed: what the command line should say instead."""


def composition_error(e: BaseException, overrides: list[str]) -> str:
    """hydra's or omegaconf's complaint about the command line, as one line naming the override and a fix: for a
    typo ("Could not override 'trian.steps'") the key it meant; for a missing group option the choices."""
    text = str(e).strip()
    match = re.search(r"Could not override '([^']+)'", text)
    if match:
        key = match.group(1)
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            keys = _config_keys(OmegaConf.to_container(hydra_compose(config_name="pretrain", overrides=[
                "out_dir=outputs/compose"])))
        close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        fix = f"did you mean {close[0]}?" if close else "check the spelling against configs/pretrain.yaml"
        return f"{key} is not a config key; {RENAMED.get(key, fix)}"
    match = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if match:
        group, name = match.groups()
        choices = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
        return f"{group}={name} is not a config of group '{group}'; choose one of: {', '.join(choices)}"
    match = re.search(r"Ambiguous value for argument '([^']+)'", text)
    if match:
        return (f"{match.group(1)} is a sweep (a comma-separated list); run it with -m (multirun), or quote a value "
                "that contains commas, e.g. \"data.split='98,2,0'\"")
    if "Could not append to config" in text or "already at" in text:
        return f"{_first_line(e)}; drop the leading '+' to change an existing key (or use '++')"
    return f"the overrides {overrides} do not compose: {_first_line(e)}; write each as KEY=VALUE (hydra syntax)"


def build_data(cfg: RunConfig, model_cfg: ModelConfig):
    """The DataSource of data.name: the embedded corpus (built into .bin/.idx on first use) or indexed
    prefixes, both read through megatron-core's GPTDataset. Datasets are built lazily, on first read."""
    d, t = cfg.data, cfg.train
    cache_dir = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
    try:
        if d.name == "default":
            prefixes, weights = [str(default_prefix(cache_dir))], None
        else:
            prefixes, weights = parse_blend(d.blend)
        source = IndexedDataSource(
            prefixes, weights, tokenizer=d.tokenizer, split=d.split, seq_len=t.seq_len,
            micro_batch_size=t.micro_batch_size, seed=cfg.seed,
            train_samples=BatchPlan.of(cfg).samples_before(t.steps),
            eval_samples=t.eval_batches * t.micro_batch_size if t.eval_every else 0, cache_dir=cache_dir)
    except (IndexedDataError, FileNotFoundError, ValueError) as e:  # bad files, tokenizer or blend: say which
        raise ConfigError(f"data.name={d.name}: {e}") from None
    preflight.check_tokenizer_fits(source.vocab_size, cfg, model_cfg)
    return source


def warn_data_repeats(cfg: RunConfig, data, say: Callable[[str], None]) -> int:
    """Say when the run will read its training data more than once, and how many times (the issue-47 user's
    10k-token corpus was read 8 times over in silence). Returns the epoch count."""
    epochs = data.epochs() if hasattr(data, "epochs") else 1
    if epochs > 1:
        say(f"[data] warning: the run reads its training data {epochs} times over ({epochs} epochs: train.steps="
            f"{cfg.train.steps} x a global batch of {cfg.train.global_batch_size} sequences of {cfg.train.seq_len} "
            f"tokens = {data.sizes[0]:,} samples); megatron-core reshuffles each epoch. More data (data.blend) or "
            "fewer train.steps reads each document once")
    return epochs


def run(cfg: RunConfig, model_cfg: ModelConfig, stop: StopFlag | None = None) -> dict:
    """Build everything from a validated config and train. Returns the run summary."""
    done = preflight.completed(cfg)
    if done:
        raise preflight.RunComplete(done)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.train.device)
    data = build_data(cfg, model_cfg)
    model = build_whole_model(cfg, model_cfg, device).model  # the stage builder's, as one stage of one
    metrics = make_metrics(cfg, model_cfg)
    warn_data_repeats(cfg, data, metrics.message)
    # Layers swapped (train.backend) and compiled before the optimizer sees their Parameters.
    prepare_model(model, backend=cfg.train.backend, compile=cfg.train.compile, device=device, log=metrics.message)
    optimizer = build_from_config(model, cfg.optimizer)
    (Path(cfg.out_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    summary = {}
    try:
        executor = ReferenceExecutor(cfg, model, optimizer, data)
        plan = simulator_run_report(executor.sim, model_cfg, cfg)
        report_memory_plan(cfg.out_dir, [(0, plan.table(), plan.total)], metrics.message)
        trainer = Trainer(cfg, executor, metrics, stop=stop)
        trainer.resume()
        summary = trainer.run()
    finally:
        metrics.close(summary)  # logs the summary line
    return summary


def make_metrics(cfg: RunConfig, model_cfg: ModelConfig, devices: int = 1, device=None) -> MetricsLogger:
    """The writer's metrics; `devices` share each step's FLOPs (the world size; 1 in one process)."""
    t, p = cfg.train, cfg.parallel
    device = torch.device(cfg.train.device if device is None else device)
    throughput = Throughput(flops_per_token(model_cfg, t.seq_len), devices,
                            device_peak_tflops(device, t.precision, t.peak_tflops))
    metrics = MetricsLogger(
        cfg.out_dir,
        total_steps=cfg.train.steps,
        config=cfg.to_dict(),
        wandb_mode=cfg.logging.wandb_mode,
        wandb_project=cfg.logging.wandb_project,
        run_name=cfg.logging.run_name,
        progress=cfg.logging.progress,
        log_every=cfg.logging.log_every,
        throughput=throughput,
        device=str(device),
    )
    counts = count_parameters(model_cfg)
    metrics.message(
        f"asyncpp: model={model_cfg.name} ({counts.total / 1e6:.2f}M params, {counts.active / 1e6:.2f}M active) "
        f"optimizer={cfg.optimizer.name} schedule={cfg.schedule.name} pp={p.pp} dp={p.dp} tp={p.tp} ep={p.ep} "
        f"ef_lambda={cfg.staleness.ef_lambda} {BatchPlan.of(cfg).describe()} global_batch={t.global_batch_size}"
        f"{f' rampup={list(t.batch_rampup)}' if t.batch_rampup else ''} "
        f"tokens/step={t.global_batch_size * t.seq_len} out_dir={cfg.out_dir}"
    )
    return metrics


def optimizer_for(cfg: RunConfig, mesh):
    """stage, sharding plan -> the stage's optimizer: Muon orthogonalizes TP-sharded matrices whole
    (optimizer.tp_mode) and shares its work over the DP replicas."""
    def build(stage, sharding):
        return build_from_config(stage, cfg.optimizer, sharding=sharding,
                                 tp_group=mesh.tp_group if mesh.dims.tp > 1 else None,
                                 dp_group=mesh.dp_group if mesh.dims.dp > 1 else None,
                                 expert_dp_group=mesh.edp_group if mesh.dims.edp > 1 else None)
    return build


def cpu_threads(env: Mapping[str, str], cores: int) -> int:
    """A CPU rank's intra-op threads: its share of the cores it may use, since N ranks share them and
    oversubscribed OpenMP threads spin instead of working. In a slurm job the allocation is the rank's share, not
    the machine: launch.slurm's script exports OMP_NUM_THREADS = the node's CPUs / ranks per node (or the
    submitter's own value). The real slurm cluster showed why (tests/slurm: two 1-CPU nodes on one 2-core machine):
    with the machine's cores // local ranks, each rank ran 2 threads on its 1 CPU and a step of the tiny pipeline
    took 4 s instead of 0.15 s."""
    if "SLURM_JOB_ID" in env and env.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(env["OMP_NUM_THREADS"]))
    return max(1, cores // int(env.get("LOCAL_WORLD_SIZE", "1")))


def run_distributed(cfg: RunConfig, model_cfg: ModelConfig, stop: StopFlag | None = None) -> dict:
    """One pipeline stage per rank (torchrun). Validated before the process group exists. Every torch.distributed
    op is kept in the rank's flight recorder, written to <run dir>/comm_ops/ when a wait gives up or a signal asks
    for a stop (parallel/flight.py)."""
    with flight.recording() as recorder:
        return _run_distributed(cfg, model_cfg, stop, recorder)


def _run_distributed(cfg: RunConfig, model_cfg: ModelConfig, stop: StopFlag | None,
                     recorder: flight.Recorder) -> dict:
    p = cfg.parallel
    check_pipeline_options(cfg, model_cfg)
    dims = ParallelDims.for_world(int(os.environ["WORLD_SIZE"]), pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
    cfg = cfg.replace(parallel=dataclasses.replace(p, dp=dims.dp))  # the resolved layout is what gets saved
    if torch.device(cfg.train.device).type == "cpu":
        torch.set_num_threads(cpu_threads(os.environ, os.cpu_count() or 1))
    device = init_distributed(torch.device(cfg.train.device).type, cfg.train.timeout_s)
    position = [lambda: (None, "the start-up (building the stage)")]  # the trainer's, once there is one
    try:
        mesh = mesh_for(cfg, model_cfg, dims, device)
        timeout = cfg.train.timeout_s
        shared = [cfg.out_dir, preflight.completed(cfg) if mesh.rank == 0 else None]
        with naming_the_peer(mesh, "rank 0's run directory (broadcast)", timeout):
            dist.broadcast_object_list(shared, src=0)  # one run directory, rank 0's (hydra's ${now} differs)
        if shared[1]:  # every rank leaves together: none waits at a collective for a rank that has gone
            raise preflight.RunComplete(shared[1])
        cfg = cfg.replace(out_dir=shared[0])
        recorder.dump_dir = Path(cfg.out_dir) / flight.DUMP_DIR
        if mesh.rank != 0:
            with naming_the_peer(mesh, "rank 0 to fill the data cache (start-up barrier)", timeout):
                dist.barrier()  # rank 0 tokenizes and fills the cache first; the others then hit it
        data = build_data(cfg, model_cfg)
        if mesh.rank == 0:
            with naming_the_peer(mesh, "the other ranks after the data cache (start-up barrier)", timeout):
                dist.barrier()
        torch.manual_seed(cfg.seed)
        metrics = make_metrics(cfg, model_cfg, dims.world_size, device) if mesh.is_writer else None
        if metrics is not None:  # the writer reads data (the last stage's labels): one warning per run
            warn_data_repeats(cfg, data, metrics.message)
        baseline = host_rss_bytes()  # the process before the model: what the memory plan does not count
        stage = build_rank_stage(cfg, model_cfg, mesh, device)  # only this rank's layers and shards
        # Layers swapped and compiled before the optimizer is built on the stage's Parameters.
        prepare_model(stage.model, backend=cfg.train.backend, compile=cfg.train.compile, device=device,
                      log=metrics.message if metrics is not None else (lambda text: None))
        executor = pipeline_executor(cfg, stage, mesh, data, optimizer_for(cfg, mesh), process_baseline_bytes=baseline)
        _print_stage_memory(cfg, mesh, executor, metrics)
        trainer = Trainer(cfg, executor, metrics, stop=stop)
        position[0] = trainer.position  # what a failure report names: the step and the action
        trainer.resume()
        summary = {}
        try:
            summary = trainer.run()
            events = executor.timeline_events()
            if events is not None:
                write_run_timeline(events, cfg.out_dir, f"{cfg.schedule.name}: P={mesh.num_stages}, "
                                   f"{executor.batches.describe()}", cfg.train.steps)
        except DELIBERATE:
            raise
        except Exception:  # a failure: the metrics lines are on disk already; closing wandb could wait on a network
            metrics = None
            raise
        finally:
            if metrics is not None:
                (Path(cfg.out_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
                metrics.close(summary)  # logs the summary line
        # No rank tears its process group down while a peer may still talk to it (gloo aborts the
        # process with "terminate called without an active exception" otherwise).
        with naming_the_peer(mesh, "every rank at the end (the final barrier)", timeout):
            dist.barrier()
    except DELIBERATE:  # raised on every rank at the same point: the ordinary teardown cannot hang
        dist.destroy_process_group()
        raise
    except Exception as e:  # one rank's bug, device error or broken link: leave without waiting on any peer
        raise failfast.abandon(e, dist.get_rank(), *position[0]()) from e
    dist.destroy_process_group()
    return summary


DELIBERATE = (ConfigError, TrainingAborted, NonFiniteUpdate, preflight.RunComplete)
"""Errors every rank raises at the same point (pretrain.py's exit codes 2 and 3, and a finished run's rerun: one
line, exit 0); any other is a failure (asyncpp/parallel/failfast.py)."""


MEMORY_PLAN_FILE = "memory_plan.txt"


def report_memory_plan(out_dir: str | Path, plans: list[tuple[int, str, int]], message) -> None:
    """Every stage's memory table ((stage, table, total bytes) each) to <out_dir>/memory_plan.txt, and one line to
    the console: a 25-line table per stage at every start buried the run's own output (issue 47)."""
    plans = sorted(plans)
    path = Path(out_dir) / MEMORY_PLAN_FILE
    path.write_text("\n\n".join(table for _, table, _ in plans) + "\n")
    totals = [total / 2**30 for _, _, total in plans]
    largest = max(range(len(totals)), key=totals.__getitem__)
    per_stage = f" (per stage: {', '.join(f'{t:.2f}' for t in totals)})" if len(totals) > 1 else ""
    message(f"memory plan: largest stage {largest}, {totals[largest]:.2f} GiB per rank{per_stage}; "
            f"the tables: {path}")


def _print_stage_memory(cfg: RunConfig, mesh: Mesh, run: PipelineExecutor, metrics) -> None:
    """Every stage's memory plan (tp/dp rank 0 of each), reported once by the metrics rank. Collective."""
    mine = run.memory_plan()
    plans = [None] * dist.get_world_size()
    with naming_the_peer(mesh, "every stage's memory table (all_gather)", cfg.train.timeout_s):
        dist.all_gather_object(plans, (mesh.pp_rank, mine.table(), mine.total) if mesh.dp_rank == 0 and mesh.tp_rank == 0 else None)
    if metrics is not None:
        report_memory_plan(cfg.out_dir, [p for p in plans if p is not None], metrics.message)


def _traced_config(cfg: RunConfig) -> RunConfig:
    """The config a dry run's trace runs: the run's, at dry_run_trace_microbatches microbatches per step if given."""
    n = cfg.dry_run_trace_microbatches
    if n is None:
        return cfg
    return cfg.replace(train=dataclasses.replace(cfg.train, num_microbatches=n, global_batch_size=None))


def trace_dry_run(cfg: RunConfig, model_cfg: ModelConfig, reports: list[dict], build_optimizer, echo) -> None:
    """dry_run_trace=true: the traced steps of dry_run_stage, or of every stage (the step-time prediction needs them
    all), each with its ops' costs; prints each trace's report and the predicted times (analysis/stagetime.py).
    Writes <out_dir>/dry_run_trace.json: the largest stage's trace (or dry_run_stage's), with the prediction."""
    stages = [cfg.dry_run_stage] if cfg.dry_run_stage is not None else [r["stage"] for r in reports]
    traced = _traced_config(cfg)
    m = traced.train.num_microbatches
    traces = []
    for stage in stages:
        echo(f"dry run trace: stage {stage}, {TRACED_STEPS} steps x {m} microbatches on meta tensors "
             f"(asyncpp/analysis/traced.py)")
        traces.append(trace_stage(traced, model_cfg, cfg.dry_run, stage, build_optimizer, tracer_cls=CostTracer))
        echo(traces[-1].report())
    p = cfg.parallel
    dims = ParallelDims.for_world(cfg.dry_run, pp=p.pp, tp=p.tp, ep=p.ep, dp=p.dp)
    text, prediction = prediction_report(cfg, model_cfg, dims, traces, num_microbatches=cfg.train.num_microbatches)
    echo(text)
    largest = max(reports, key=lambda r: r["memory"]["total_bytes"])["stage"]
    kept = next((t for t in traces if t.stage == largest), traces[0])
    out = Path(cfg.out_dir) / "dry_run_trace.json"
    out.write_text(json.dumps({**kept.to_dict(), "prediction": prediction}, indent=1))
    echo(f"wrote {out} (stage {kept.stage}; {sum(t.wall_s for t in traces):.1f} s traced)")


def _step_layerless_stages(cfg: RunConfig, model_cfg: ModelConfig, reports: list[dict], build_optimizer,
                           echo) -> None:
    """A stage without transformer layers (only its vocabulary rows: parallel.stage_layers with zeros) runs code
    paths no other stage does: its gradient list holds only the head rows, which are in flight with the tied
    reduction at UPDATE_START (issue 44: the real run crashed there, the layout alone had passed). Its training
    step is therefore executed on meta tensors too (analysis/traced.py: the run's engine, reductions and
    optimizer), so the dry run fails where the run would. Cheap: such a stage holds a slice of one matrix."""
    for r in reports:
        if r["layers"][0] == r["layers"][1]:
            echo(f"dry run: layer-less stage {r['stage']} (only its vocabulary rows): its training step runs on meta "
                 f"tensors, {TRACED_STEPS} steps, as the run executes it")
            trace = trace_stage(cfg, model_cfg, cfg.dry_run, r["stage"], build_optimizer)
            r["traced_actions"] = [a.action for a in trace.actions]


def run_dry(cfg: RunConfig, model_cfg: ModelConfig, echo=print) -> list[dict]:
    """dry_run=N: the layout at N ranks on a fake process group (asyncpp/analysis/dryrun.py); trains nothing.
    Writes <out_dir>/dry_run.json and returns the per-stage reports."""
    def build_stage(mesh, spec):
        stage = build_rank_stage(cfg, model_cfg, mesh, "meta")  # the real run's build, stopped before allocating
        return stage.model, stage.sharding

    def build_optimizer(stage, plan, mesh):
        return optimizer_for(cfg, mesh)(stage, plan)

    reports = dry_run(cfg, model_cfg, cfg.dry_run, build_stage, build_optimizer,
                      out=Path(cfg.out_dir) / "dry_run.json", echo=echo)
    _step_layerless_stages(cfg, model_cfg, reports, build_optimizer, echo)
    if cfg.dry_run_trace:
        trace_dry_run(cfg, model_cfg, reports, build_optimizer, echo)
    return reports
