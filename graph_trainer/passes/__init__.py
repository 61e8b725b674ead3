"""Graph passes over the traced step: the registry and the pipeline built from config.

Fixed order (each may be turned off with `compile.disable_passes`):

1. `dce`                   dead-code elimination (keeps in-place and random ops)   bitwise
2. `remove_noops`          drop detach/alias/same-shape views/t(t(x))               bitwise
3. `activation_checkpoint` tag save/recompute (mode selective or full)             bitwise
4. `memory_budget`         tag save/recompute to fit a memory budget (mode budget) bitwise
5. `fsdp_gather`           tag re-gather/keep of FSDP parameter gathers (dp_shard)  bitwise
6. `remat`                 duplicate recomputed ops into the backward               bitwise

Then the memory estimate of the final graph fills `TracedStep.memory_estimate`.
Save/recompute is decided once (3 or 4, and 5 for gathered parameters) and made
final by 6; nothing after `remat` re-decides it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from graph_trainer.config import JobConfig
from graph_trainer.errors import ConfigError
from graph_trainer.log import get_logger
from graph_trainer.passes.activation_checkpoint import parse_overrides, tag_activation_checkpoint
from graph_trainer.passes.budget import tag_memory_budget
from graph_trainer.passes.cleanup import dead_code_elimination, remove_noops
from graph_trainer.passes.fsdp_gather import tag_fsdp_gathers
from graph_trainer.passes.pipeline import GraphPass, PassContext, Pipeline, check_disabled
from graph_trainer.passes.remat import rematerialize
from graph_trainer.tracer.capture import TracedStep

logger = get_logger(__name__)


def _ac_mode(*modes: str) -> Callable[[JobConfig], bool]:
    return lambda cfg: cfg.activation_checkpoint.mode in modes


def _always(cfg: JobConfig) -> bool:
    return True


def _sharded(cfg: JobConfig) -> bool:
    return cfg.parallelism.dp_shard > 1


def _remat_needed(cfg: JobConfig) -> bool:
    return _ac_mode("selective", "full", "budget")(cfg) or (
        _sharded(cfg) and cfg.parallelism.fsdp_reshard_after_forward != "never")


REGISTRY: tuple[GraphPass, ...] = (
    GraphPass("dce", lambda gm, ctx: dead_code_elimination(gm), True, _always,
              "dead-code elimination; in-place and random ops survive"),
    GraphPass("remove_noops", lambda gm, ctx: remove_noops(gm), True, _always,
              "remove detach/alias, same-shape views and t(t(x))"),
    GraphPass("activation_checkpoint",
              lambda gm, ctx: tag_activation_checkpoint(gm, ctx.cfg.activation_checkpoint,
                                                        input_categories=ctx.input_categories), True,
              _ac_mode("selective", "full"), "tag save/recompute per op (selective / full)"),
    GraphPass("memory_budget",
              lambda gm, ctx: tag_memory_budget(gm, ctx.cfg.activation_checkpoint,
                                                input_categories=ctx.input_categories),
              True, _ac_mode("budget"), "tag save/recompute to fit activation_checkpoint.memory_budget"),
    GraphPass("fsdp_gather", lambda gm, ctx: tag_fsdp_gathers(gm, ctx.cfg.parallelism.fsdp_reshard_after_forward),
              True, _sharded, "tag re-gather (recompute) or keep (save) of each FSDP unit's parameter gather"),
    GraphPass("remat", lambda gm, ctx: rematerialize(gm), True, _remat_needed,
              "duplicate recomputed forward ops just before their first backward use"),
)


def available_passes() -> list[str]:
    """Names accepted by `compile.disable_passes`, in pipeline order."""
    return [p.name for p in REGISTRY]


def build_pipeline(cfg: JobConfig, *, dump_dir: Path | None) -> Callable[[TracedStep], TracedStep]:
    """The pipeline for `cfg`: enabled passes in registry order, minus `compile.disable_passes`.

    Validates at build time (trainer start-up), before anything is traced.

    Raises:
        ConfigError: an unknown name in `compile.disable_passes`, an override
            entry naming no ATen op, or budget mode without the passes it needs.
    """
    check_disabled(cfg.compile.disable_passes, list(REGISTRY))
    parse_overrides(cfg.activation_checkpoint)
    passes = [p for p in REGISTRY if p.enabled(cfg) and p.name not in cfg.compile.disable_passes]
    if cfg.activation_checkpoint.mode == "none" and (cfg.activation_checkpoint.save_list
                                                     or cfg.activation_checkpoint.recompute_list):
        logger.info("activation_checkpoint.save_list/recompute_list are ignored with "
                    "activation_checkpoint.mode = 'none'")
    if cfg.activation_checkpoint.mode == "budget" and "remat" in cfg.compile.disable_passes:
        raise ConfigError("activation_checkpoint.mode = 'budget' needs the 'remat' pass; remove it from "
                          "compile.disable_passes or choose another activation_checkpoint.mode")
    return Pipeline(cfg, passes, dump_dir=dump_dir)


__all__ = ["REGISTRY", "GraphPass", "PassContext", "Pipeline", "available_passes", "build_pipeline"]
