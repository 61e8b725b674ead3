"""Graph passes over the traced step: the registry and the pipeline built from config.

Fixed order (each may be turned off with `compile.disable_passes`); each pass declares when it runs (from the
config sections it reads), which facts it needs from earlier passes and which it establishes:

| # | pass            | runs when                                  | needs          | gives          | numerics |
|---|-----------------|--------------------------------------------|----------------|----------------|----------|
| 1 | `dce`           | always                                     |                |                | bitwise  |
| 2 | `remove_noops`  | always                                     |                |                | bitwise  |
| 3 | `memory_policy` | activation_checkpoint.mode != none         |                | recompute tags | bitwise  |
| 4 | `fsdp_gather`   | parallelism.dp_shard > 1                   |                | recompute tags | bitwise  |
| 5 | `remat`         | a policy tags anything to recompute        | recompute tags | rematerialized | bitwise  |
| 6 | `fsdp_prefetch` | parallelism.dp_shard > 1 and fsdp_prefetch |                |                | bitwise  |

The pipeline returns the final graph with its memory estimate (`Transformed`). Its stages (`GraphPass.stage`):
1-2 clean up, 3-4 decide, 5-6 apply the decisions. The clean-up passes read no option, so every AC mode's
pipeline starts with them: the planner runs them once and plans each mode from there.
Save/recompute is decided once (3, and 4 for gathered parameters, which 3 never
tags) and made final by 5; nothing after `remat` re-decides it. With a mode
other than `none`, 3 and 5 cannot be disabled: the step would silently run
without the policy asked for. A pass whose needs no earlier pass gives is
refused by name before anything is traced. The rules every pass keeps are in
passes/README.md; the pipeline checks them after each pass.

`memory_policy_transform` gives the same pipeline to a user's own model and
step (`graph_trainer.tracer.GraphStep(model, transform=...)`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.load import parse_ac_option
from graph_trainer.job_config.memory_budget import parse_memory_budget
from graph_trainer.job_config.schema import ActivationCheckpointConfig, JobConfig
from graph_trainer.observability.log import get_logger
from graph_trainer.optimizer.update_memory import Accumulation, EagerUpdate
from graph_trainer.passes.budget_depth import BlockChoice
from graph_trainer.passes.cleanup import dead_code_elimination, remove_noops
from graph_trainer.passes.fsdp_gather import tag_fsdp_gathers
from graph_trainer.passes.fsdp_prefetch import prefetch_fsdp_gathers
from graph_trainer.passes.memory_policy import MODES, memory_policy
from graph_trainer.passes.op_patterns import parse_overrides
from graph_trainer.passes.pipeline import (
    APPLY,
    CLEAN_UP,
    STAGES,
    GraphPass,
    PassConfig,
    PassContext,
    Pipeline,
    check_disabled,
    check_needs,
)
from graph_trainer.passes.remat import rematerialize
from graph_trainer.tracer.capture import TracedStep
from graph_trainer.tracer.executor import Transformed

logger = get_logger(__name__)

RECOMPUTE_TAGS = "recompute tags"  # node.meta["recompute"] / ["ac_graph_id"] on forward nodes
REMATERIALIZED = "rematerialized"  # recomputed ops copied into the backward


def _always(config: PassConfig) -> bool:
    return True


def _policy_asked(config: PassConfig) -> bool:
    return config.ac.mode != "none"


def _sharded(config: PassConfig) -> bool:
    return config.parallelism.shards_parameters


def _anything_to_recompute(config: PassConfig) -> bool:
    regathers = _sharded(config) and config.parallelism.fsdp_reshard_after_forward != "never"
    return _policy_asked(config) or regathers


def _fsdp_policy(config: PassConfig) -> str | None:
    """What the `fsdp_gather` pass will do with the gathers (None: no FSDP), for the budget's model to apply."""
    return config.parallelism.fsdp_reshard_after_forward if _sharded(config) else None


def fsdp_policy_of(cfg: JobConfig) -> str | None:
    """What the `fsdp_gather` pass will do with `cfg`'s gathers (None: no FSDP), as the budget's model applies it."""
    return _fsdp_policy(PassConfig(cfg.activation_checkpoint, cfg.parallelism))


def _prefetching(config: PassConfig) -> bool:
    return _sharded(config) and config.parallelism.fsdp_prefetch


def fsdp_prefetch_of(cfg: JobConfig) -> bool:
    """Whether the `fsdp_prefetch` pass runs on `cfg`'s step, for the budget's model to keep room for it."""
    return _prefetching(PassConfig(cfg.activation_checkpoint, cfg.parallelism))


REGISTRY: tuple[GraphPass, ...] = (
    GraphPass(
        "dce",
        lambda gm, ctx: dead_code_elimination(gm),
        True,
        _always,
        "dead-code elimination; in-place and random ops survive",
        stage=CLEAN_UP,
    ),
    GraphPass(
        "remove_noops",
        lambda gm, ctx: remove_noops(gm),
        True,
        _always,
        "remove detach/alias, same-shape views and t(t(x))",
        stage=CLEAN_UP,
    ),
    GraphPass(
        "memory_policy",
        lambda gm, ctx: memory_policy(
            gm,
            ctx.config.ac,
            input_categories=ctx.input_categories,
            fsdp_policy=_fsdp_policy(ctx.config),
            gathers_prefetched=_prefetching(ctx.config),
            eager_update=ctx.config.eager_update,
            accumulation=ctx.config.accumulation,
            budget_choice=ctx.config.budget_choice,
        ),
        True,
        _policy_asked,
        "tag save/recompute per op (selective / full / budget, plus overrides)",
        reads=("activation_checkpoint", "parallelism.fsdp_reshard_after_forward", "parallelism.fsdp_prefetch"),
        gives=(RECOMPUTE_TAGS,),
    ),
    GraphPass(
        "fsdp_gather",
        lambda gm, ctx: tag_fsdp_gathers(gm, ctx.config.parallelism.fsdp_reshard_after_forward),
        True,
        _sharded,
        "tag re-gather (recompute) or keep (save) of each unit's parameter gather",
        reads=("parallelism.dp_shard", "parallelism.fsdp_reshard_after_forward"),
        gives=(RECOMPUTE_TAGS,),
    ),
    GraphPass(
        "remat",
        lambda gm, ctx: rematerialize(gm),
        True,
        _anything_to_recompute,
        "duplicate recomputed forward ops just before their first backward use",
        reads=("activation_checkpoint.mode", "parallelism.fsdp_reshard_after_forward"),
        needs=(RECOMPUTE_TAGS,),
        gives=(REMATERIALIZED,),
        stage=APPLY,
    ),
    GraphPass(
        "fsdp_prefetch",
        lambda gm, ctx: prefetch_fsdp_gathers(gm),
        True,
        _prefetching,
        "issue each parameter all-gather right after the previous one's wait (overlaps communication)",
        reads=("parallelism.dp_shard", "parallelism.fsdp_prefetch"),
        stage=APPLY,
    ),
)


def available_passes() -> list[str]:
    """Names accepted by `compile.disable_passes`, in pipeline order."""
    return [p.name for p in REGISTRY]


def pipeline_for(
    config: PassConfig,
    *,
    disable_passes: Sequence[str] = (),
    dump_dir: Path | None = None,
    log_saved_activations: bool = False,
) -> Pipeline:
    """The pipeline for `config`: the passes that it enables, in registry order, minus `disable_passes`.

    Validates before anything is traced.

    Raises:
        ConfigError: an unknown or renamed name in `disable_passes`, a policy pass disabled while
            `activation_checkpoint.mode` asks for it, a pass whose needs no earlier pass gives, or an
            override entry naming no ATen op.
    """
    ac = config.ac
    check_disabled(list(disable_passes), list(REGISTRY))
    if ac.mode not in MODES:
        raise ConfigError(f"activation_checkpoint.mode must be one of {'|'.join(MODES)}, got {ac.mode!r}")
    parse_overrides(ac.save_list, ac.recompute_list)
    if ac.mode != "none":
        for name in ("memory_policy", "remat"):
            if name in disable_passes:
                raise ConfigError(
                    f"compile.disable_passes has {name!r}, but activation_checkpoint.mode = "
                    f"'{ac.mode}' needs it (without it the step would run with no checkpointing); "
                    f"remove {name!r} from compile.disable_passes or set "
                    "--activation_checkpoint.mode none"
                )
    elif ac.save_list or ac.recompute_list:
        logger.info(
            "activation_checkpoint.save_list/recompute_list are ignored with activation_checkpoint.mode = 'none'"
        )
    passes = [p for p in REGISTRY if p.enabled(config) and p.name not in disable_passes]
    check_needs(passes, list(REGISTRY))
    return Pipeline(passes, config, dump_dir=dump_dir, log_saved_activations=log_saved_activations)


def build_pipeline(
    cfg: JobConfig,
    *,
    dump_dir: Path | None,
    budget_choice: BlockChoice | None = None,
    eager_update: EagerUpdate | None = None,
    accumulation: Accumulation | None = None,
) -> Pipeline:
    """The pipeline a job's config asks for (`activation_checkpoint`, `parallelism` and `compile` sections); see
    `pipeline_for`. Graphs are written under `dump_dir` only with `compile.dump_graphs`. `budget_choice`: the
    budget's choice planned on a deep model's short traces (`passes.budget_depth`). `eager_update`: the AdamW
    update the job runs after the graph (`builder.Job.eager_update`), which a size budget leaves room for, and
    `accumulation` the step's micro-batches (`builder.Job.accumulation`), whose micro-step it leaves room beside."""
    c = cfg.compile
    return pipeline_for(
        PassConfig(cfg.activation_checkpoint, cfg.parallelism, budget_choice, eager_update, accumulation),
        disable_passes=c.disable_passes,
        dump_dir=dump_dir if c.dump_graphs else None,
        log_saved_activations=c.log_saved_activations,
    )


def memory_policy_transform(
    mode: str = "selective",
    *,
    selective_ac_option: str | int = "op",
    memory_budget: str | float = 0.5,
    save_list: Sequence[str] = (),
    recompute_list: Sequence[str] = (),
    dump_dir: Path | None = None,
) -> Callable[[TracedStep], Transformed]:
    """The pass pipeline with a memory policy, for your own model: pass it as `GraphStep(model, transform=...)`.

    The same passes the trainer runs (clean-up, `memory_policy`, `remat`) and the
    same memory estimate (`GraphStep.memory_estimate`), without a job config:

        from graph_trainer.passes import memory_policy_transform
        from graph_trainer.tracer import GraphStep

        step = GraphStep(model, loss_fn=my_loss, transform=memory_policy_transform("selective"))
        loss, grad_norm = step(batch)

    The policy works per transformer layer: the layers are found as the tracer
    finds them (`graph_trainer.tracer.layers`). Every mode preserves numerics bitwise.

    Args:
        mode: "none" | "selective" | "full" | "budget" (as `activation_checkpoint.mode`).
        selective_ac_option: selective only: "op" (save matmul and attention outputs, recompute
            every second matmul and the rest) or N (checkpoint every N-th layer fully).
        memory_budget: budget only: a fraction <= 1 of the no-AC activation memory, or the whole step's peak
            with its unit ("40GiB"; `graph_trainer.job_config.memory_budget`).
        save_list / recompute_list: op patterns always saved / recomputed, e.g. "aten.mm" or
            "layers.*.attention::aten.mm" (see `graph_trainer.passes.op_patterns`).
        dump_dir: write each trace's graph before and after every pass there.

    Raises:
        ConfigError: an unknown mode, selective option, budget or op pattern (before anything is traced).
    """
    parse_memory_budget(memory_budget)
    ac = ActivationCheckpointConfig(
        mode=mode,
        selective_ac_option=parse_ac_option(selective_ac_option),
        memory_budget=memory_budget,
        save_list=list(save_list),
        recompute_list=list(recompute_list),
    )
    return pipeline_for(PassConfig(ac), dump_dir=dump_dir)


__all__ = [
    "CLEAN_UP",
    "REGISTRY",
    "STAGES",
    "GraphPass",
    "PassConfig",
    "PassContext",
    "Pipeline",
    "available_passes",
    "build_pipeline",
    "fsdp_policy_of",
    "fsdp_prefetch_of",
    "memory_policy_transform",
    "pipeline_for",
]
