"""The traced step, stage by stage: the one route from a trace to the graph that runs.

    traced = trace(job, batch)        # forward, loss, backward (and the update) as one graph; no pass has run
    result = transform(job, traced)   # the job's checks and pass pipeline: save/recompute decided and applied
    result = compile(job, result)     # the compile stage `compile.backend` asks for (none: the graph as it is)

The executor runs `transform` then `compile` on every trace its step makes (`Job.graph_step`, through
`step_transform`); the planner runs `trace` and `transform` on the meta device, and plans the graph that would
be compiled. Neither sets the other's fields, and neither names a pass: the pipeline's stages (`passes.STAGES`)
are where a caller may stop and resume. `transform(..., until=CLEAN_UP)` runs the passes that no option changes;
`transform(..., after=CLEAN_UP)` runs the rest, so the planner cleans a trace once and plans each AC mode from it.

`job` is a `builder.Job`. The builder builds every step through this module, which sits below it: it reads the
job through the three members it uses (`StagedJob`), not by importing the builder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from graph_trainer.distributed.parallelism import ParallelModel
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.passes import build_pipeline
from graph_trainer.passes.pipeline import Pipeline
from graph_trainer.tracer.capture import TracedStep
from graph_trainer.tracer.executor import GraphStep, Transformed

# The last stage `Job.graph_step` takes each fresh trace through.
TRACE, TRANSFORM, COMPILE = "trace", "transform", "compile"


class StagedJob(Protocol):
    """What the stages read of a job (`builder.Job`): its config, its parallelisms' check of a trace, its step, the
    memory budget's choice planned for it (`passes.budget_depth`; None: solved on each graph), the update it runs
    after the graph and its micro-batches (what a whole-step size budget leaves room for)."""

    cfg: JobConfig
    parallel: ParallelModel
    budget_choice: Any

    def graph_step(self, *, until: str = COMPILE, **options: Any) -> GraphStep: ...

    def eager_update(self) -> Any: ...

    def accumulation(self) -> Any: ...


def trace(job: StagedJob, batch: Mapping[str, torch.Tensor]) -> TracedStep:
    """`job`'s step traced on `batch` (with gradient accumulation: the micro-batch graph), before any check or
    pass; the executor would trace the same graph for this batch."""
    return job.graph_step(until=TRACE).ensure_traced(batch)


def transform(
    job: StagedJob,
    traced: TracedStep,
    *,
    until: str | None = None,
    after: str | None = None,
    pipeline: Pipeline | None = None,
) -> Transformed:
    """`traced` checked by the job's parallelisms (unless `after` is given: checked already) and rewritten by its
    pass pipeline, from the stage after `after` to `until` (`passes.STAGES`; None: the whole pipeline).

    The whole pipeline returns the final graph with its memory estimate; a part of it, the graph alone
    (`memory_estimate` None). The passes rewrite `traced.gm`: copy it first to keep it. `pipeline`: the job's
    pipeline built once (the executor's, whose graph dumps are numbered across traces); default: built here.

    Raises:
        UserError: what the parallelisms cannot run; ConfigError: a pass configuration that cannot run.
    """
    pipeline = pipeline or _pipeline(job, dump_dir=None)
    if after is None:
        traced = job.parallel.check_traced(traced)  # e.g. with FSDP: every parameter read goes through its gather
    if until is None and after is None:
        return pipeline(traced)
    part = pipeline.part(until=until, after=after)
    if until is None:
        return part(traced)
    return Transformed(dataclasses.replace(traced, gm=part.run_passes(traced.gm, traced.layout.categories)))


def _pipeline(job: StagedJob, *, dump_dir: Path | None) -> Pipeline:
    """`job`'s pass pipeline, with what its memory budget reads of the job beyond the config."""
    return build_pipeline(
        job.cfg,
        dump_dir=dump_dir,
        budget_choice=job.budget_choice,
        eager_update=job.eager_update(),
        accumulation=job.accumulation(),
    )


def compile(job: StagedJob, result: Transformed) -> Transformed:  # noqa: A001 (the stage's name)
    """`result` through the compile stage `compile.backend` asks for: Inductor (whole or region by region, with
    CUDA graphs when asked), or none (returned as it is)."""
    cfg = job.cfg
    if cfg.compile.backend != "inductor":
        return result
    from graph_trainer.compiler.inductor import InductorStage

    return InductorStage(cudagraphs=cfg.compile.cudagraphs, regional=cfg.compile.regional)(result)


def step_transform(job: StagedJob, *, until: str = COMPILE, dump_dir: Path | None = None) -> Callable | None:
    """What `Job.graph_step`'s executor runs on each fresh trace: `transform`, then `compile` when `until` is
    COMPILE, with one pipeline for every trace (built now, so that a bad pass configuration is refused before the
    first trace); None for TRACE (the trace as it is)."""
    if until not in (TRACE, TRANSFORM, COMPILE):
        raise ValueError(f"until must be one of {TRACE!r}, {TRANSFORM!r}, {COMPILE!r}; got {until!r}")
    if until == TRACE:
        return None
    pipeline = _pipeline(job, dump_dir=dump_dir)
    if until == TRANSFORM:
        return lambda traced: transform(job, traced, pipeline=pipeline)
    return lambda traced: compile(job, transform(job, traced, pipeline=pipeline))
