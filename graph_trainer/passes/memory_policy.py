"""The memory policy: decide, once and on the whole-step graph, which forward values to save or recompute.

One pass for every `activation_checkpoint.mode`:
- `selective` / `full`: a fixed policy per layer (`activation_checkpoint.tag_activation_checkpoint`);
- `budget`: save as much as fits `memory_budget` (`budget.tag_memory_budget`);
- `none`: nothing to decide (the pipeline leaves the pass out);
and in every mode the per-op `save_list` / `recompute_list` overrides
(`graph_trainer.passes.op_patterns`) win over the policy.

Reads the tracer's `phase`, `layer_id`, `module_fqn` and `random` tags and the
fake values in `node.meta["val"]` (and in budget mode, with FSDP, the gather policy
that the `fsdp_gather` pass applies next, so the budget holds for the final graph);
writes torch's `node.meta["recompute"]` and `node.meta["ac_graph_id"]` on
transformer-layer forward ops, nothing else.
`remat` must run after it to act on the tags. Metadata only: preserves
numerics bitwise.
"""

from __future__ import annotations

import torch.fx

from graph_trainer.job_config.schema import ActivationCheckpointConfig
from graph_trainer.optimizer.update_memory import Accumulation, EagerUpdate
from graph_trainer.passes.activation_checkpoint import tag_activation_checkpoint
from graph_trainer.passes.budget import tag_memory_budget
from graph_trainer.passes.budget_depth import BlockChoice
from graph_trainer.tracer import node_meta

MODES = ("none", "selective", "full", "budget")


def memory_policy(
    gm: torch.fx.GraphModule,
    ac: ActivationCheckpointConfig,
    *,
    input_categories: list[str] | None = None,
    fsdp_policy: str | None = None,
    gathers_prefetched: bool = False,
    eager_update: EagerUpdate | None = None,
    accumulation: Accumulation | None = None,
    budget_choice: BlockChoice | None = None,
) -> torch.fx.GraphModule:
    """Tag `gm`'s layer ops save/recompute as `ac.mode` asks (see module docstring). In place; returns `gm`.

    Args:
        gm: the traced step (after clean-up), with the tracer's metadata.
        ac: the activation-checkpointing section (mode, selective option, budget, overrides).
        input_categories: one memory category per graph input (budget and full mode
            compare estimated peaks, which need them).
        fsdp_policy: with FSDP, `parallelism.fsdp_reshard_after_forward`: the budget's model re-gathers as the
            later `fsdp_gather` pass will, so the budget holds for the final graph.
        gathers_prefetched: with FSDP, `parallelism.fsdp_prefetch`: the budget keeps room for the one unit's gathers
            the later `fsdp_prefetch` pass may hold early.
        eager_update: the AdamW update run after the graph (None: in it): a size budget is the whole step's, so
            the budget leaves room for its state beside the graph and refuses a size below its own peak.
        accumulation: the step's micro-batches when `gm` is a micro-step of several: a size budget leaves room for
            what is alive beside it (`passes.budget.Accumulation`).
        budget_choice: budget only: the choice planned on a deep model's short traces (`passes.budget_depth`).

    Raises:
        ConfigError: an infeasible budget, or a recompute override of an op that is never recomputed.
    """
    if not any(node_meta.is_forward(n) for n in gm.graph.nodes):
        # No forward, nothing saved for a backward: an accumulated step's update graph (tracer.capture.PARTS).
        return gm
    if ac.mode == "budget":
        return tag_memory_budget(
            gm,
            ac,
            input_categories=input_categories,
            fsdp_policy=fsdp_policy,
            gathers_prefetched=gathers_prefetched,
            eager_update=eager_update,
            accumulation=accumulation,
            block_choice=budget_choice,
        )
    if ac.mode in ("selective", "full"):
        return tag_activation_checkpoint(gm, ac, input_categories=input_categories)
    if ac.mode == "none":
        return gm
    raise ValueError(f"activation_checkpoint.mode must be one of {'|'.join(MODES)}, got {ac.mode!r}")
