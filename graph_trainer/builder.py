"""The one job builder: what a config builds before the loop, for the trainer, the planner and the benchmarks.

    data = build_data(cfg, mesh)                        # tokenizer + this data-parallel rank's batches
    job = build_job(cfg, mesh, vocab_needed=data.tokenizer.vocab_size)
    step = job.build_step()                             # eager or traced (+ passes, + compile stage)

`build_job(..., materialize=False)` builds the same job on the meta device: the preflight and `--dry-run`
plan exactly the step that runs (the same loss, the same parallelisms, the same update in the graph or
eager with the implementation the run uses, the same pass pipeline) without allocating it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from graph_trainer.checkpoint.hf import Pretrained
from graph_trainer.data.hf_datasets import Shuffle
from graph_trainer.data.loader import CHAT_SOURCE, build_dataloader
from graph_trainer.data.packing import PackedLoader
from graph_trainer.data.tokenizer import Tokenizer, build_tokenizer
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.parallelism import ParallelModel
from graph_trainer.distributed.parallelize import parallelize_model
from graph_trainer.errors import ConfigError, UserError
from graph_trainer.job_config.batching import accumulation_steps
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.model_args import get_model_spec
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.loss import build_lm_loss
from graph_trainer.optimizer.adamw import GraphAdamW, build_optimizer, choose_adamw_implementation, init_adamw_state
from graph_trainer.optimizer.lr_schedule import build_lr_scheduler
from graph_trainer.optimizer.update_memory import Accumulation, EagerUpdate
from graph_trainer.runtime.device import resolve_dtype
from graph_trainer.stages import COMPILE, step_transform
from graph_trainer.step import EvalStep, TrainStep
from graph_trainer.tracer.capture import LossFn, TraceError
from models.common.spec import ModelSpec


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


@dataclasses.dataclass
class JobData:
    """The tokenizer and this data-parallel rank's batches (and its held-out batches, with validation)."""

    tokenizer: Tokenizer
    loader: PackedLoader
    validation: PackedLoader | None = None


def gather_over_data_ranks(mesh: Mesh):
    """A function that collects one picklable value from every data-parallel rank, in data-rank order (a
    collective over every rank; tensor-parallel peers hold the same value). None for one process."""
    if not mesh.is_distributed:
        return None

    def gather(value):
        everyone = [None] * mesh.world_size
        torch.distributed.all_gather_object(everyone, (mesh.data_rank, value), group=mesh.world_group)
        by_data_rank = dict(everyone)
        return [by_data_rank[r] for r in range(mesh.data_size)]

    return gather


def _validation_source(cfg: JobConfig) -> tuple[str, tuple[int, bool] | None]:
    """(path, holdout) of the held-out data: `validation.path`, or the training data's held-out documents.

    Raises:
        ConfigError: a source that cannot give held-out text (synthetic), or a path for one that reads no file.
    """
    v, source = cfg.validation, cfg.data.source
    if v.path:
        if source in ("embedded", "synthetic"):
            raise ConfigError(
                f'validation.path is set but data.source = "{source}" reads no file; drop validation.path to '
                f"hold out every validation.holdout_every-th document, or train on a file source"
            )
        return v.path, None
    if source == "synthetic":
        raise ConfigError(
            'validation on data.source = "synthetic" has no text to hold out; set data.source to a text source '
            "or --validation.enable false"
        )
    return cfg.data.path, (v.holdout_every, True)


def build_data(cfg: JobConfig, mesh: Mesh) -> JobData:
    """The configured tokenizer and the batches of this rank's data-parallel slice (tensor-parallel peers, when
    there are any, read the same batches), and with `validation.enable` the held-out batches. A training batch is one
    step's: with gradient accumulation, every micro-batch of it (the step cuts it).

    Held out: `validation.path` (read as `data.source` reads `data.path`) or, without it, every
    `validation.holdout_every`-th document of the training data, which training then skips.
    """
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    t, d = cfg.training, cfg.data
    common = dict(
        batch_size=t.local_batch_size,
        seq_len=t.seq_len,
        seed=t.seed,
        rank=mesh.data_rank,
        world_size=mesh.data_size,
        text_column=d.text_column,
        streaming=d.streaming,
        document_masking=d.document_masking,
        chat_template=d.chat_template,
    )
    validation, held_out = None, None
    if cfg.validation.enable:
        path, held_out = _validation_source(cfg)
        option = "validation.path" if cfg.validation.path else "data.path"
        validation = build_dataloader(d.source, path, tokenizer, holdout=held_out, option=option, **common)
    kept = None if held_out is None else (held_out[0], False)
    gather = gather_over_data_ranks(mesh)
    # A training batch is one step's (every micro-batch); the eval step runs one local batch at a time.
    common["batch_size"] = t.local_batch_size * accumulation_steps(cfg)
    # Only training is shuffled: validation reads the same held-out batches every time.
    shuffle = Shuffle(seed=t.seed, buffer=d.shuffle_buffer) if d.shuffle else None
    loader = build_dataloader(d.source, d.path, tokenizer, gather=gather, holdout=kept, shuffle=shuffle, **common)
    return JobData(tokenizer, loader, validation)


def initial_weights(cfg: JobConfig) -> Pretrained | None:
    """The pretrained weights the job starts from (`checkpoint.initial_load_path`), opened and checked against the
    model (no tensor read yet); None for random weights, and for a resume, whose checkpoint wins.

    Raises:
        UserError: the folder is not a Hugging Face model folder of the configured model.
    """
    c = cfg.checkpoint
    if not c.initial_load_path or c.resume:
        return None
    return Pretrained.open(c.initial_load_path, get_model_spec(cfg.model.name), resolve_model_args(cfg))


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


def build_job_scheduler(cfg: JobConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The job's learning-rate schedule over `cfg.training.steps` steps."""
    s = cfg.lr_scheduler
    return build_lr_scheduler(
        optimizer,
        warmup_steps=s.warmup_steps,
        total_steps=cfg.training.steps,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    )


def job_loss(cfg: JobConfig, device: torch.device) -> LossFn:
    """The job's loss before any parallelism wraps it: chunked as configured, under autocast when asked."""
    t = cfg.training
    return autocast_loss(resolve_dtype(t.dtype, device, t.mixed_precision_param), device, t.loss_chunk_size)


@dataclasses.dataclass
class Job:
    """A config built: the model with its parallelisms applied, the optimizer, LR schedule and loss.

    `model` is on `mesh.device` (or on the meta device, for planning); `parallel` answers for the
    parallelisms (none for one process); `loss_fn` is the loss as the parallelisms run it.
    """

    cfg: JobConfig
    mesh: Mesh
    spec: ModelSpec
    model: nn.Module
    parallel: ParallelModel
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loss_fn: LossFn
    # The memory budget's choice planned on this deep model's short traces (`StepPlan.budget_choice`), or None:
    # the budget pass then applies it instead of solving the whole graph.
    budget_choice: Any = None

    @property
    def device(self) -> torch.device:
        return self.mesh.device

    def num_params(self) -> int:
        """Parameters of the whole model (every rank's shards together), from the family's own count."""
        return self.spec.num_params(self.model.args)

    def flops_per_token(self) -> float:
        """Training FLOPs per token at the job's sequence length, from the family's own formula."""
        return self.spec.flops_per_token(self.model.args, self.cfg.training.seq_len)

    def eager_update(self) -> EagerUpdate | None:
        """What the AdamW update run after the graph costs in memory (None: the update is in the graph)."""
        if optimizer_in_graph(self.cfg):
            return None
        return EagerUpdate.of(self.optimizer, adamw_implementation_for(self.cfg, self.device), self.device)

    def accumulation(self) -> Accumulation | None:
        """The step's micro-batches, as the memory budget reads them (None: one micro-batch a step, or a pipeline
        whose schedule runs the micro-batches around its stages' graphs)."""
        steps = accumulation_steps(self.cfg)
        if steps == 1 or self.parallel.runs_step():
            return None
        traced = optimizer_in_graph(self.cfg)
        state = sum(t.numel() * t.element_size() for t in GraphAdamW(self.optimizer).state_tensors()) if traced else 0
        return Accumulation(steps, state)

    def with_budget_choice(self, choice: Any) -> Job:
        """The same job, its budget pass applying `choice` (`StepPlan.budget_choice`; None: solving whole)."""
        return dataclasses.replace(self, budget_choice=choice)

    def with_config(self, cfg: JobConfig) -> Job:
        """The same model, optimizer and parallelisms under another config (e.g. another AC mode, to plan it)."""
        return dataclasses.replace(self, cfg=cfg)

    def build_step(
        self,
        *,
        dump_dir: Path | None = None,
        failure_dir: Path | None = None,
        planned_graph: Any = None,
        optimizer_update: bool = True,
    ) -> TrainStep:
        """The job's training step: eager (`compile.mode eager`) or traced with the pass pipeline and compile stage.

        The step runs the optimizer update itself (unless `optimizer_update` is False): in the graph with
        `compile.trace_optimizer`, else eagerly after it.

        Args:
            dump_dir: where `compile.dump_graphs` writes the graphs (None: nowhere).
            failure_dir: where a failing trace leaves its partial graph.
            planned_graph: the preflight's final graph of this step (`StepPlan.step_graph`): the first step runs
                it instead of tracing again when nothing differs between the two (see `_reusable`).
            optimizer_update: False leaves the update to the caller (the eager baseline plans without it).

        Raises:
            ConfigError: compile options that cannot run together, or a bad pass configuration.
        """
        from graph_trainer.compiler.options import check_compile_config

        cfg = self.cfg
        check_compile_config(
            cfg.compile.backend, cfg.compile.cudagraphs, cfg.compile.mode, self.device, regional=cfg.compile.regional
        )
        if cfg.compile.mode == "eager":
            return self.eager_step(optimizer_update=optimizer_update)
        step = self.graph_step(dump_dir=dump_dir, failure_dir=failure_dir, optimizer_update=optimizer_update)
        if planned_graph is not None and _reusable(cfg):
            step.reuse_trace(planned_graph, "the preflight")
        return step

    def eager_step(self, *, optimizer_update: bool = True) -> TrainStep:
        """The step run by plain autograd, with eager activation checkpointing as configured."""
        from graph_trainer.eager.checkpointing import apply_eager_checkpointing
        from graph_trainer.eager.step import EagerStep

        apply_eager_checkpointing(self.model, self.cfg.activation_checkpoint)
        optimizer = self.optimizer if optimizer_update else None
        runs_step = self.parallel.runs_step()  # pipeline stages: the parallelism runs the step and the update
        step = EagerStep(
            self.model,
            loss_fn=self.loss_fn,
            max_norm=self.cfg.training.max_norm,
            grad_reduce=self.parallel.grad_reduce(),
            optimizer=None if runs_step else optimizer,
            norm_reduce=self.parallel.norm_reduce(),
            **self._accumulation(),
        )
        return self.parallel.wrap_step(step, optimizer if runs_step else None, self.cfg.training.max_norm)

    def build_eval_step(self, *, failure_dir: Path | None = None) -> EvalStep:
        """The job's evaluation step (forward and loss, no gradients): eager with `compile.mode eager`, else its
        own traced graph, run uncompiled, whose peak the memory estimate gives."""
        if self.cfg.compile.mode == "eager":
            from graph_trainer.eager.eval_step import EagerEvalStep

            return EagerEvalStep(self.model, loss_fn=self.loss_fn)
        from graph_trainer.tracer.eval_step import GraphEvalStep

        return GraphEvalStep(
            self.model,
            loss_fn=self.loss_fn,
            device=self.device,
            failure_dir=failure_dir,
            layers=self.spec.parallel_plan.layers,
        )

    def _accumulation(self) -> dict[str, Any]:
        """What the step runs around its micro-batches: their number, the token count's reduction, and the model's
        once-per-step update after all of them."""
        return {
            "accumulation_steps": accumulation_steps(self.cfg),
            "count_reduce": self.parallel.count_reduce(),
            "step_update": self.spec.step_update,  # once per step, after every micro-batch: a MoE's balancing bias
            # Masked labels (instruction data): the global batch's count divides the loss, accumulating or not.
            "count_tokens": self.cfg.data.source == CHAT_SOURCE,
        }

    def graph_step(
        self,
        *,
        dump_dir: Path | None = None,
        failure_dir: Path | None = None,
        optimizer_update: bool = True,
        until: str = COMPILE,
    ) -> Any:
        """The traced step (`graph_trainer.tracer.GraphStep`), each of whose traces goes through the stages of
        `graph_trainer.stages` up to `until`: the checks and pass pipeline (TRANSFORM: the graph the planner plans),
        then the compile stage `compile.backend` asks for (COMPILE). TRACE: the trace as it is."""
        from graph_trainer.tracer.executor import GraphStep

        cfg = self.cfg
        optimizer = self.optimizer if optimizer_update else None
        # A parallelism that runs the step around the graph (pipeline stages) runs the update too.
        runs_step = self.parallel.runs_step()
        in_graph = optimizer is not None and optimizer_in_graph(cfg) and not runs_step
        accumulation = self._accumulation()
        if (micro := self.parallel.micro_batches_per_step()) is not None:
            accumulation["accumulation_steps"] = micro
        step = GraphStep(
            self.parallel.traced_model(),
            loss_fn=self.loss_fn,
            max_norm=cfg.training.max_norm,
            optimizer=GraphAdamW(optimizer) if in_graph else None,
            eager_optimizer=None if in_graph or runs_step else optimizer,
            on_shape_change=cfg.compile.on_shape_change,
            transform=step_transform(self, until=until, dump_dir=dump_dir),
            device=self.device,
            failure_dir=failure_dir,
            grad_reduce=self.parallel.grad_reduce(),
            norm_reduce=self.parallel.norm_reduce(),
            layers=self.spec.parallel_plan.layers,
            **accumulation,
        )
        return self.parallel.wrap_step(step, optimizer if runs_step else None, cfg.training.max_norm)


def _reusable(cfg: JobConfig) -> bool:
    """Whether the preflight's graph is the step's: the preflight runs no compile stage and writes no graph dumps
    (the run folder is not ready then); everything else it builds as the step does."""
    return cfg.compile.backend == "none" and not cfg.compile.dump_graphs


def build_job(cfg: JobConfig, mesh: Mesh, *, materialize: bool = True, vocab_needed: int = 0) -> Job:
    """Build `cfg`'s job for this rank of `mesh`: the model (materialized on `mesh.device` and initialized, or
    filled from `checkpoint.initial_load_path`, or on the meta device for planning), its parallelisms applied,
    the optimizer with its state, the LR schedule and the loss as the parallelisms run it.

    Raises:
        UserError: the tokenizer needs more ids than the model's vocabulary has, the parallelisms refuse the model,
            or the pretrained weights do not fit it.
    """
    spec = get_model_spec(cfg.model.name)
    # Pretrained weights are opened only by a build that materializes them: planning builds short models of 3 and
    # 4 blocks (the depth-free plan), which the folder must never be checked against. They are read into the
    # meta-built model after the parallelisms cut it: a rank reads only its own shards, and the full model never
    # exists in host memory.
    pretrained = initial_weights(cfg) if materialize else None
    random_init = materialize and pretrained is None
    model = build_model(cfg, mesh.device if random_init else None, vocab_needed=vocab_needed)
    model.train()
    # From here on, a sharded parameter is this rank's part of it (same names, smaller shapes).
    parallel = parallelize_model(model, mesh, cfg, spec.parallel_plan)
    if pretrained is not None:
        pretrained.load_into(model, parallel, mesh.device)
    optimizer = build_job_optimizer(cfg, model, mesh.device)
    scheduler = build_job_scheduler(cfg, optimizer)
    loss_fn = parallel.wrap_loss(job_loss(cfg, mesh.device))
    return Job(cfg, mesh, spec, model, parallel, optimizer, scheduler, loss_fn)


__all__ = [
    "Job",
    "JobData",
    "adamw_implementation_for",
    "autocast_loss",
    "build_data",
    "build_job",
    "build_job_optimizer",
    "build_job_scheduler",
    "build_model",
    "cli_trace_errors",
    "initial_weights",
    "job_loss",
    "optimizer_in_graph",
]
