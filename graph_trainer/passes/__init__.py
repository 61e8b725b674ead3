"""Graph passes over the traced step: the registry and the pipeline built from config.

Fixed order (each may be turned off with `compile.disable_passes`):

1. `dce`            dead-code elimination (keeps in-place and random ops)         bitwise
2. `remove_noops`   drop detach/alias/same-shape views/t(t(x))                     bitwise
3. `memory_policy`  tag save/recompute (activation_checkpoint.mode selective,
                    full or budget, plus the save/recompute overrides)            bitwise
4. `fsdp_gather`    tag re-gather/keep of each FSDP unit's parameter gather
                    (parallelism.dp_shard > 1 only)                                 bitwise
5. `remat`          duplicate recomputed ops into the backward                     bitwise
6. `fsdp_prefetch`  issue each FSDP all-gather right after the previous one's wait
                    (parallelism.fsdp_prefetch)                                     bitwise

The pipeline returns the final graph with its memory estimate (`Transformed`).
Save/recompute is decided once (3, and 4 for gathered parameters, which 3 never
tags) and made final by 5; nothing after `remat` re-decides it. With a mode
other than `none`, 3 and 5 cannot be disabled: the
step would silently run without the policy asked for.

`memory_policy_transform` gives the same pipeline to a user's own model and
step (`graph_trainer.tracer.GraphStep(model, transform=...)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.load import parse_ac_option
from graph_trainer.job_config.schema import ActivationCheckpointConfig, JobConfig
from graph_trainer.observability.log import get_logger
from graph_trainer.passes.cleanup import dead_code_elimination, remove_noops
from graph_trainer.passes.fsdp_gather import POLICIES as FSDP_GATHER_POLICIES
from graph_trainer.passes.fsdp_gather import tag_fsdp_gathers
from graph_trainer.passes.fsdp_prefetch import prefetch_fsdp_gathers
from graph_trainer.passes.memory_policy import MODES, memory_policy
from graph_trainer.passes.op_patterns import parse_overrides
from graph_trainer.passes.pipeline import GraphPass, PassContext, Pipeline, check_disabled
from graph_trainer.passes.remat import rematerialize
from graph_trainer.tracer.capture import TracedStep
from graph_trainer.tracer.executor import Transformed

logger = get_logger(__name__)


def _always(ac: ActivationCheckpointConfig) -> bool:
    return True


def _policy_asked(ac: ActivationCheckpointConfig) -> bool:
    return ac.mode != "none"


def _only_with_fsdp(ac: ActivationCheckpointConfig) -> bool:
    return False  # switched on by `pipeline_for(fsdp_gather=...)`, which binds the gather policy


REGISTRY: tuple[GraphPass, ...] = (
    GraphPass(
        "dce",
        lambda gm, ctx: dead_code_elimination(gm),
        True,
        _always,
        "dead-code elimination; in-place and random ops survive",
    ),
    GraphPass(
        "remove_noops",
        lambda gm, ctx: remove_noops(gm),
        True,
        _always,
        "remove detach/alias, same-shape views and t(t(x))",
    ),
    GraphPass(
        "memory_policy",
        lambda gm, ctx: memory_policy(gm, ctx.ac, input_categories=ctx.input_categories),
        True,
        _policy_asked,
        "tag save/recompute per op (selective / full / budget, plus overrides)",
    ),
    GraphPass(
        "fsdp_gather",
        lambda gm, ctx: gm,
        True,
        _only_with_fsdp,
        "tag re-gather (recompute) or keep (save) of each FSDP unit's parameter gather",
    ),
    GraphPass(
        "remat",
        lambda gm, ctx: rematerialize(gm),
        True,
        _policy_asked,
        "duplicate recomputed forward ops just before their first backward use",
    ),
    GraphPass(
        "fsdp_prefetch",
        lambda gm, ctx: prefetch_fsdp_gathers(gm),
        True,
        _only_with_fsdp,
        "issue each FSDP all-gather right after the previous one's wait (overlaps communication)",
    ),
)


def available_passes() -> list[str]:
    """Names accepted by `compile.disable_passes`, in pipeline order."""
    return [p.name for p in REGISTRY]


def pipeline_for(
    ac: ActivationCheckpointConfig,
    *,
    disable_passes: Sequence[str] = (),
    dump_dir: Path | None = None,
    log_saved_activations: bool = False,
    fsdp_gather: str | None = None,
    fsdp_prefetch: bool = False,
) -> Pipeline:
    """The pipeline for an activation-checkpointing section: enabled passes in registry order, minus `disable_passes`.

    Validates before anything is traced. `fsdp_gather` is the FSDP gather policy
    (`parallelism.fsdp_reshard_after_forward`) of a sharded step, None otherwise:
    it turns on `fsdp_gather`, and `remat` when the backward re-gathers;
    `fsdp_prefetch` then turns on `fsdp_prefetch`.

    Raises:
        ConfigError: an unknown or renamed name in `disable_passes`, a policy pass
            disabled while `ac.mode` asks for it, or an override entry naming no ATen op.
    """
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
    wanted = {p.name for p in REGISTRY if p.enabled(ac)}
    if fsdp_gather is not None:
        if fsdp_gather not in FSDP_GATHER_POLICIES:
            raise ConfigError(
                f"parallelism.fsdp_reshard_after_forward must be one of "
                f"{'|'.join(FSDP_GATHER_POLICIES)}, got {fsdp_gather!r}"
            )
        wanted |= {"fsdp_gather"} | ({"remat"} if fsdp_gather != "never" else set())
        wanted |= {"fsdp_prefetch"} if fsdp_prefetch else set()
    passes = [_bound(p, fsdp_gather) for p in REGISTRY if p.name in wanted and p.name not in disable_passes]
    return Pipeline(passes, ac, dump_dir=dump_dir, log_saved_activations=log_saved_activations)


def _bound(p: GraphPass, fsdp_gather: str | None) -> GraphPass:
    """`p`, with the FSDP gather policy bound into the `fsdp_gather` pass."""
    if p.name != "fsdp_gather":
        return p
    return dataclasses.replace(p, run=lambda gm, ctx: tag_fsdp_gathers(gm, fsdp_gather))


def build_pipeline(cfg: JobConfig, *, dump_dir: Path | None) -> Pipeline:
    """The pipeline a job's config asks for (`activation_checkpoint` and `compile` sections); see `pipeline_for`.

    Graphs are written under `dump_dir` only with `compile.dump_graphs`.
    """
    c = cfg.compile
    sharded = cfg.parallelism.dp_shard > 1
    return pipeline_for(
        cfg.activation_checkpoint,
        disable_passes=c.disable_passes,
        dump_dir=dump_dir if c.dump_graphs else None,
        log_saved_activations=c.log_saved_activations,
        fsdp_gather=cfg.parallelism.fsdp_reshard_after_forward if sharded else None,
        fsdp_prefetch=sharded and cfg.parallelism.fsdp_prefetch,
    )


def memory_policy_transform(
    mode: str = "selective",
    *,
    selective_ac_option: str | int = "op",
    memory_budget: float = 0.5,
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
        memory_budget: budget only: <= 1 is a fraction of the no-AC activation memory, > 1 GiB.
        save_list / recompute_list: op patterns always saved / recomputed, e.g. "aten.mm" or
            "layers.*.attention::aten.mm" (see `graph_trainer.passes.op_patterns`).
        dump_dir: write each trace's graph before and after every pass there.

    Raises:
        ConfigError: an unknown mode, selective option, a budget <= 0 or a bad op pattern (before anything
            is traced).
    """
    if memory_budget <= 0:
        raise ConfigError(f"memory_budget must be > 0 (a fraction <= 1 or GiB > 1), got {memory_budget}")
    ac = ActivationCheckpointConfig(
        mode=mode,
        selective_ac_option=parse_ac_option(selective_ac_option),
        memory_budget=memory_budget,
        save_list=list(save_list),
        recompute_list=list(recompute_list),
    )
    return pipeline_for(ac, dump_dir=dump_dir)


__all__ = [
    "REGISTRY",
    "GraphPass",
    "PassContext",
    "Pipeline",
    "available_passes",
    "build_pipeline",
    "memory_policy_transform",
    "pipeline_for",
]
