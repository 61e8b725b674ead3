"""The eager activation-checkpointing baseline: `torch.utils.checkpoint` around each transformer layer.

The same policies as the graph passes (`graph_trainer.passes.memory_policy`):
- full: plain `checkpoint` of every layer (recomputes everything in it);
- selective "op": `create_selective_checkpoint_contexts` saving matmul and
  attention outputs, MoE routing outputs (`graph_utils.ROUTING_OPS`) and tensor parallelism's reduce-scatters,
  recomputing every second matmul of each layer (the counter restarts per layer) and everything else;
- selective N: plain `checkpoint` of layers N-1, 2N-1, ... (every N-th, from 1).
In every mode an all-to-all (expert parallelism's token exchange) is saved, never run again, as the graph's
passes force it (passes/activation_checkpoint.py): so full mode runs through a policy too (one that, without
all-to-alls, recomputes everything: plain `checkpoint`).
Per-op overrides without a module glob (`"aten.mm"`) apply inside checkpointed
layers. Budget mode exists only on the graph.

Eager recomputation replays random ops under the saved RNG state, so the
numbers match the graph (which saves random ops instead) bitwise.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from graph_trainer.distributed.fsdp import layer_forward
from graph_trainer.errors import ConfigError
from graph_trainer.job_config.schema import ActivationCheckpointConfig
from graph_trainer.passes.op_patterns import OpPattern, parse_overrides
from graph_trainer.tracer.graph_utils import (
    ALL_TO_ALL_OPS,
    is_attention,
    is_matmul,
    is_reduce_scatter,
    is_routing,
    packet,
)
from graph_trainer.tracer.layers import transformer_layers


def _policy_factory(selective_op: bool, save: list[OpPattern], recompute: list[OpPattern]):
    """A fresh policy function per checkpointed call (its matmul counters belong to that layer call)."""

    def make():
        # Forward and recompute must reach the same decisions: count them separately.
        counts = {False: 0, True: 0}

        def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
            matmul_save = True
            if is_matmul(func):
                counts[ctx.is_recompute] += 1
                matmul_save = counts[ctx.is_recompute] % 2 == 1
            if packet(func) in ALL_TO_ALL_OPS or any(p.matches_op(func) for p in save):
                return CheckpointPolicy.MUST_SAVE
            if any(p.matches_op(func) for p in recompute):
                return CheckpointPolicy.PREFER_RECOMPUTE
            # A reduce-scatter inside a layer is tensor parallelism's, after a row-parallel matmul: saved, as the
            # graph's selective policy saves it (passes/activation_checkpoint.py).
            saved_kind = is_attention(func) or is_reduce_scatter(func) or is_routing(func)
            if selective_op and (saved_kind or (is_matmul(func) and matmul_save)):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return make


def _checkpointed_forward(forward, context_fn, *args: Any, **kwargs: Any):
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_eager_checkpointing(model: nn.Module, ac: ActivationCheckpointConfig) -> list[str]:
    """Wrap the forward of each chosen transformer layer of `model` with `torch.utils.checkpoint`.

    The layer's `forward` is replaced on the instance, so parameter names and
    state dicts are unchanged. Returns the FQNs of the wrapped layers.

    Raises:
        ConfigError: budget mode (graph-only) or a module-qualified override.
    """
    if ac.mode == "none":
        return []
    if ac.mode == "budget":
        raise ConfigError(
            "activation_checkpoint.mode = 'budget' is graph-only; use --compile.mode trace "
            "or choose selective/full for eager"
        )
    save, recompute = parse_overrides(ac.save_list, ac.recompute_list)
    if any(p.module is not None for p in save + recompute):
        raise ConfigError(
            "module-qualified save_list/recompute_list entries ('<glob>::aten.<op>') are "
            "graph-only; use --compile.mode trace or plain 'aten.<op>' entries"
        )
    layers = transformer_layers(model)
    selective_op = ac.mode == "selective" and ac.selective_ac_option == "op"
    if ac.mode == "selective" and not selective_op:
        n_th = int(ac.selective_ac_option)
        chosen = [fqn for fqn, i in layers.items() if (i + 1) % n_th == 0]
    else:
        chosen = list(layers)
    # Every mode runs through a policy, for the all-to-alls it must save; without them (no expert parallelism) a
    # policy that recomputes everything is plain `checkpoint`, the same ops and the same memory.
    context_fn = _policy_factory(selective_op, save, recompute)
    for fqn in chosen:
        layer = model.get_submodule(fqn)
        # The class's forward, bound (wrapping twice would nest checkpoints), or FSDP's gathering
        # forward around it, so that the recompute gathers the parameters again.
        forward = layer_forward(layer)
        layer.forward = functools.partial(_checkpointed_forward, forward, context_fn)
    return chosen
