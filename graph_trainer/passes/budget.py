"""Memory-budget activation checkpointing: save as much as fits, recompute the cheapest bytes first.

The `budget` mode of the `memory_policy` pass (`passes/memory_policy.py`).

Reads and writes the same metadata as `activation_checkpoint` (whose structural
rules it keeps: layer regions, saved boundaries, random and in-place ops never
recomputed, per-op overrides pinned). Metadata only: preserves numerics bitwise.

Budget (`graph_trainer.job_config.memory_budget`): a fraction <= 1 of the no-AC
activation memory (the estimated step peak minus the graph inputs: parameters,
buffers, batch, optimizer state, which no checkpointing policy changes), or a
size with its unit ("40GiB") for the whole step's peak, everything included.

Algorithm (greedy order, first fitting prefix):
1. Candidates are the layer ops that own a storage the backward reads in the
   no-AC graph (only those free memory when recomputed). Views always follow
   their base, and ops whose output the backward does not read are tagged
   recompute for free: they only run again if a recomputed op needs them.
2. Candidates are ranked once by bytes freed per recompute FLOP (the op's own
   FLOPs plus those of the free ops feeding it, as `torch.utils.flop_counter`
   counts them: `graph_utils.node_flops`), ties by larger bytes, then graph
   order. torch counts matmuls and attention only, so elementwise ops (cost
   taken as 1 FLOP) come first, largest first, and matmuls last.
3. Prefix k recomputes the first k candidates. A fixed set of prefixes (at most
   `MAX_PROBES` + 1, evenly spaced, always including 0 and all) is
   rematerialized and its peak estimated exactly (the same estimate that
   equals the measured CPU peak); the no-AC graph is probed first.
4. The first probed prefix whose estimated peak fits the budget is chosen.

Why: the order does not depend on the budget, and the first fitting prefix is
monotone by construction: for budgets b' < b, every prefix fitting b' fits b,
so the choice k' for b' is at or after the choice k for b; if prefix k fits b'
then k' = k, otherwise peak(k') <= b' < peak(k). So the estimated (and on CPU
the measured) peak never increases as the budget decreases, even where the
peak is not monotone in k (it is not: recomputed copies can overlap badly).
An infeasible budget is reported with the smallest probed peak.
"""

from __future__ import annotations

import torch.fx

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.memory_budget import parse_memory_budget
from graph_trainer.job_config.schema import ActivationCheckpointConfig
from graph_trainer.observability.log import get_logger
from graph_trainer.observability.units import GIB
from graph_trainer.passes.activation_checkpoint import (
    RECOMPUTE,
    SAVE,
    Decisions,
    StepStructure,
    analyze,
    apply_overrides,
    finalize,
    write_tags,
)
from graph_trainer.passes.op_patterns import parse_overrides
from graph_trainer.passes.remat import peak_after_remat
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import is_view, node_flops, storage_key, storage_keys, tensors
from graph_trainer.tracer.memory_estimate import estimate_peak_memory

MAX_PROBES = 48

logger = get_logger(__name__)


def _backward_storages(gm: torch.fx.GraphModule) -> set[int]:
    """Storages read by a backward op (in the untagged graph: what is saved for backward)."""
    keys: set[int] = set()
    for n in gm.graph.nodes:
        if node_meta.is_backward(n):
            for a in n.all_input_nodes:
                if not node_meta.is_backward(a):
                    keys |= storage_keys(a)
    return keys


def rank_candidates(
    structure: StepStructure, pinned: set[torch.fx.Node], saved_storages: set[int]
) -> tuple[list[torch.fx.Node], set[torch.fx.Node]]:
    """(candidates in greedy order, free nodes tagged recompute regardless)."""
    order = {n: i for i, n in enumerate(structure.layer_nodes)}
    layer_set = set(structure.layer_nodes)
    free: set[torch.fx.Node] = set()
    gains: dict[torch.fx.Node, int] = {}
    for n in structure.layer_nodes:
        if n in structure.forced or n in pinned:
            continue
        keys = storage_keys(n)
        owned = keys - set().union(*(storage_keys(a) for a in n.all_input_nodes)) if n.all_input_nodes else keys
        if is_view(n) or not (owned & saved_storages):
            free.add(n)
        else:
            gains[n] = sum(
                int(t.untyped_storage().nbytes())
                for t in tensors(n.meta.get("val"))
                if storage_key(t) in owned & saved_storages
            )

    def cost(n: torch.fx.Node) -> int:
        total, stack, seen = node_flops(n), [*n.all_input_nodes], set()
        while stack:
            a = stack.pop()
            if a in seen or a not in free or a not in layer_set:
                continue
            seen.add(a)
            total += node_flops(a)
            stack.extend(a.all_input_nodes)
        return max(total, 1)

    ranked = sorted(gains, key=lambda n: (-gains[n] / cost(n), -gains[n], order[n]))
    return ranked, free


def probe_points(n: int) -> list[int]:
    """Prefix lengths probed: 0, n and evenly spaced ones between, at most MAX_PROBES + 1."""
    steps = min(n, MAX_PROBES)
    return sorted({round(i * n / steps) for i in range(steps + 1)}) if n else [0]


def tag_memory_budget(
    gm: torch.fx.GraphModule, ac: ActivationCheckpointConfig, *, input_categories: list[str] | None = None
) -> torch.fx.GraphModule:
    """Tag `gm` so its estimated peak fits `ac.memory_budget` with the fewest recompute FLOPs (see module docstring).

    In place; returns `gm`.

    Raises:
        ConfigError: the budget is below the smallest peak any probed choice reaches
            (the message gives the smallest feasible budget in the user's unit).
    """
    structure = analyze(gm)
    no_ac = estimate_peak_memory(gm, input_categories=input_categories)
    budget = parse_memory_budget(ac.memory_budget)
    target = budget.target(input_bytes=no_ac.input_bytes, no_ac_peak=no_ac.peak_bytes)

    save, recompute = parse_overrides(ac.save_list, ac.recompute_list)
    pinned_decisions = apply_overrides(structure, {}, save, recompute)
    candidates, free = rank_candidates(structure, set(pinned_decisions), _backward_storages(gm))

    def decisions_for(k: int) -> Decisions:
        chosen = set(candidates[:k])
        d: Decisions = {n: RECOMPUTE if n in free or n in chosen else SAVE for n in structure.layer_nodes}
        d.update(pinned_decisions)
        return finalize(structure, d)

    if no_ac.peak_bytes <= target:
        write_tags(gm, structure, {})  # the no-AC graph fits: recompute nothing
        logger.info(
            f"memory_budget: the no-AC peak {no_ac.peak_bytes / GIB:.4f} GiB fits the target "
            f"{target / GIB:.4f} GiB; nothing recomputed"
        )
        return gm
    chosen_k, smallest = None, no_ac.peak_bytes
    for k in probe_points(len(candidates)):
        write_tags(gm, structure, decisions_for(k))
        peak = peak_after_remat(gm, input_categories)
        smallest = min(smallest, peak)
        if peak <= target:
            chosen_k = k
            break
    if chosen_k is None:
        write_tags(gm, structure, {})  # leave no half-made choice behind
        needed = budget.smallest(smallest, input_bytes=no_ac.input_bytes, no_ac_peak=no_ac.peak_bytes)
        raise ConfigError(
            f"activation_checkpoint.memory_budget {ac.memory_budget} is infeasible: the smallest reachable peak "
            f"is {smallest / GIB:.4f} GiB ({(smallest - no_ac.input_bytes) / GIB:.4f} GiB of activations); "
            f"set --activation_checkpoint.memory_budget {needed} or more, or lower the batch size "
            "or sequence length"
        )
    write_tags(gm, structure, decisions_for(chosen_k))
    flops = sum(node_flops(n) for n in candidates[:chosen_k])
    logger.info(
        f"memory_budget: target peak {target / GIB:.4f} GiB; recompute {chosen_k}/{len(candidates)} "
        f"candidates (~{flops / 1e9:.3f} GFLOP of recompute, not counting free ops)"
    )
    return gm
