"""Building a job's model, optimizer and step from its config: one builder for the preflight and the trainer.

The preflight (`graph_trainer.plan.planner`) builds the same model (on the meta
device), the same optimizer and the same step as the trainer, so it plans the
step that runs: the same loss, the same update (in the graph or eager, with the
implementation the run uses) and the same pass pipeline.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from graph_trainer.distributed.fsdp import FSDP, ShardGroup, check_gathered, fully_shard_model
from graph_trainer.errors import UserError
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.loss import build_lm_loss
from graph_trainer.optimizer.adamw import GraphAdamW, build_optimizer, choose_adamw_implementation, init_adamw_state
from graph_trainer.runtime.device import DTYPES
from graph_trainer.step import TrainStep
from graph_trainer.tracer.capture import GradReduce, LossFn, TraceError
from models import get_model_spec


def autocast_loss(dtype: torch.dtype, device: torch.device, chunk_size: int = 0) -> LossFn:
    """The LM loss (chunked when `chunk_size` > 0), under bf16 autocast when the compute dtype asks for it."""
    base = build_lm_loss(chunk_size)
    if dtype == torch.float32:
        return base

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return base(model, batch)

    return loss_fn


@contextlib.contextmanager
def cli_trace_errors():
    """Give a trace failure the command line's way out instead of the tracer API's."""
    try:
        yield
    except TraceError as e:
        if e.fix != TraceError.API_FIX:
            raise
        raise TraceError(e.problem, fix="fix the code or run with --compile.mode eager") from e


def build_model(cfg: JobConfig, device: torch.device | None, *, vocab_needed: int = 0) -> nn.Module:
    """The configured model: on the meta device (shapes only) when `device` is None, else materialized on
    `device` and initialized with `training.seed`.

    Raises:
        UserError: the tokenizer needs more ids than the model's vocabulary has.
    """
    args = resolve_model_args(cfg)
    if vocab_needed > args.vocab_size:
        raise UserError(
            f"the tokenizer has {vocab_needed} ids but model.vocab_size is {args.vocab_size}; "
            "set model.vocab_size >= the tokenizer's vocabulary"
        )
    with torch.device("meta"):
        model = get_model_spec(cfg.model.name).model_cls(args)
    if device is None:
        return model
    model.to_empty(device=device)
    torch.manual_seed(cfg.training.seed)
    model.init_weights()
    return model


def shard_model(cfg: JobConfig, model: nn.Module, group: ShardGroup | None) -> FSDP | None:
    """FSDP over `group` (None: no sharding, returns None), with the configured mixed precision; in place."""
    if group is None:
        return None
    t = cfg.training
    return fully_shard_model(
        model, group, param_dtype=DTYPES[t.mixed_precision_param], reduce_dtype=DTYPES[t.mixed_precision_reduce]
    )


def optimizer_in_graph(cfg: JobConfig) -> bool:
    """Whether the job traces the AdamW update into the step graph."""
    return cfg.compile.mode == "trace" and cfg.compile.trace_optimizer


def adamw_implementation_for(cfg: JobConfig, device: torch.device) -> str:
    """The AdamW implementation the job's update runs (see `choose_adamw_implementation`)."""
    return choose_adamw_implementation(cfg.optimizer.implementation, device, trace_optimizer=optimizer_in_graph(cfg))


def build_job_optimizer(cfg: JobConfig, model: nn.Module, device: torch.device) -> torch.optim.AdamW:
    """`torch.optim.AdamW` over `model` with its state created up front (so step 1's memory is every step's)."""
    o = cfg.optimizer
    optimizer = build_optimizer(
        model,
        name=o.name,
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        implementation=adamw_implementation_for(cfg, device),
    )
    for group in optimizer.param_groups:
        for p in group["params"]:
            init_adamw_state(optimizer, p)
    return optimizer


def build_step(
    cfg: JobConfig,
    model: nn.Module,
    optimizer: torch.optim.AdamW,
    device: torch.device,
    *,
    loss_fn: LossFn,
    grad_reduce: GradReduce | None = None,
    dump_dir: Path | None = None,
    failure_dir: Path | None = None,
    planned_graph: Any = None,
    fsdp: FSDP | None = None,
) -> TrainStep:
    """The job's training step: eager (`compile.mode eager`) or traced with the pass pipeline and compile stage.

    The step runs the optimizer update itself: in the graph with `compile.trace_optimizer`, else eagerly after it.

    Args:
        dump_dir: where `compile.dump_graphs` writes the graphs (None: nowhere).
        failure_dir: where a failing trace leaves its partial graph.
        planned_graph: the preflight's final graph of this step (`StepPlan.step_graph`): the first
            step runs it instead of tracing again when nothing differs between the two (see `_reusable`).
        fsdp: the model's FSDP sharding (`parallelism.dp_shard`): the loss runs with the root unit
            gathered, the clip norm is global, and a trace that reads a shard ungathered is refused.

    Raises:
        ConfigError: compile options that cannot run together, or a bad pass configuration.
    """
    from graph_trainer.compiler.inductor import check_compile_config

    check_compile_config(
        cfg.compile.backend, cfg.compile.cudagraphs, cfg.compile.mode, device, regional=cfg.compile.regional
    )
    norm_reduce = None
    if fsdp is not None:
        loss_fn, norm_reduce = fsdp.wrap_loss(loss_fn), fsdp.norm_reduce
    if cfg.compile.mode == "eager":
        from graph_trainer.eager.checkpointing import apply_eager_checkpointing
        from graph_trainer.eager.step import EagerStep

        apply_eager_checkpointing(model, cfg.activation_checkpoint)
        return EagerStep(
            model,
            loss_fn=loss_fn,
            max_norm=cfg.training.max_norm,
            grad_reduce=grad_reduce,
            optimizer=optimizer,
            norm_reduce=norm_reduce,
        )
    from graph_trainer.passes import build_pipeline
    from graph_trainer.tracer.executor import GraphStep

    passes = build_pipeline(cfg, dump_dir=dump_dir)
    # With FSDP the graph as traced is checked first: every parameter read goes through its gather.
    pipeline = passes if fsdp is None else (lambda traced: passes(check_gathered(traced)))
    transform = pipeline
    if cfg.compile.backend == "inductor":
        from graph_trainer.compiler.inductor import InductorStage

        stage = InductorStage(cudagraphs=cfg.compile.cudagraphs, regional=cfg.compile.regional)
        transform = lambda traced: stage(pipeline(traced))  # noqa: E731 (the pipeline, then the compile stage)
    in_graph = optimizer_in_graph(cfg)
    step = GraphStep(
        model,
        loss_fn=loss_fn,
        max_norm=cfg.training.max_norm,
        optimizer=GraphAdamW(optimizer) if in_graph else None,
        eager_optimizer=None if in_graph else optimizer,
        on_shape_change=cfg.compile.on_shape_change,
        transform=transform,
        device=device,
        failure_dir=failure_dir,
        grad_reduce=grad_reduce,
        norm_reduce=norm_reduce,
    )
    if planned_graph is not None and _reusable(cfg, grad_reduce):
        step.reuse_trace(planned_graph, "the preflight")
    return step


def _reusable(cfg: JobConfig, grad_reduce: GradReduce | None) -> bool:
    """Whether the preflight's graph is the step's: the preflight traces without the data-parallel gradient
    reduction, runs no compile stage and writes no graph dumps (the run folder is not ready then)."""
    return grad_reduce is None and cfg.compile.backend == "none" and not cfg.compile.dump_graphs
