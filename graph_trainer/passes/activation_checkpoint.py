"""Selective and full activation checkpointing on the whole-step graph: decide, per forward op, save or recompute.

The `selective` and `full` modes of the `memory_policy` pass (`passes/memory_policy.py`),
and the structural rules its `budget` mode (`passes/budget.py`) keeps too.

Reads (tracer metadata, see `graph_trainer.tracer.node_meta`): `phase`,
`layer_id`, `module_fqn` and `random` in `node.meta["custom"]`, and
`node.meta["val"]` (fake tensors: storages, for aliasing and mutation).
Writes torch's own `node.meta["recompute"]` (a `CheckpointPolicy`) and
`node.meta["ac_graph_id"]` (the layer index + 1) on every forward op inside a
transformer layer; nothing else. `remat` then acts on these tags. The graph's
ops are unchanged, so this pass preserves numerics bitwise by itself.

Rules every policy obeys (`StepStructure`):
- each transformer layer is a region; ops outside the layers (embedding, final
  norm, output projection, loss) are never tagged, hence never recomputed;
- a layer op whose value is used by a forward op outside its layer (the
  residual stream at the layer boundary) is saved;
- random ops (`node_meta.is_random`: dropout, SDPA with dropout_p > 0) are saved:
  running them again would draw new random numbers. Attention without dropout is
  deterministic: `selective` saves it, `full` recomputes it like eager
  `torch.utils.checkpoint` does (saving it in every layer costs more than
  eager full checkpointing once the model is deep);
- in-place ops, tensors they write into, and ops that read a tensor which a
  later forward/backward op writes into are saved: a recompute would see
  different values;
- expert parallelism's all-to-alls inside a layer and their waits are saved: a recompute would send the
  tokens again (tensor parallelism's sequence all-gathers stay the policy's choice: gathered again in the
  backward, as Megatron does);
- a multi-output op's `getitem`s share their parent's decision.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.schema import ActivationCheckpointConfig
from graph_trainer.observability.log import get_logger
from graph_trainer.passes.op_patterns import OpPattern, parse_overrides
from graph_trainer.passes.remat import peak_after_remat, remat_graph
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import (
    ATTENTION_OPS,
    copy_graph,
    is_all_to_all_or_its_wait,
    is_attention,
    is_matmul,
    is_mutating,
    is_routing,
    layer_forward_nodes,
    mutated_args,
    storage_keys,
)

logger = get_logger(__name__)

SAVE = CheckpointPolicy.MUST_SAVE
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


# --------------------------------------------------------------------------- structure of the step


@dataclasses.dataclass
class StepStructure:
    """What every policy must respect: the layer ops, and which of them must be saved (and why)."""

    layer_nodes: list[torch.fx.Node]
    forced: dict[torch.fx.Node, str]  # node -> reason it can never be recomputed

    def layers(self) -> dict[int, list[torch.fx.Node]]:
        out: dict[int, list[torch.fx.Node]] = {}
        for n in self.layer_nodes:
            out.setdefault(node_meta.layer_id(n), []).append(n)
        return out


def analyze(gm: torch.fx.GraphModule) -> StepStructure:
    """Find the layer ops and the ones that must be saved (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # Last position at which each storage is written by a forward/backward op (the
    # optimizer's in-place updates run after every recompute, so they do not count).
    last_write: dict[int, int] = {}
    for n in nodes:
        if is_mutating(n) and node_meta.phase(n) != node_meta.OPTIMIZER:
            for arg in mutated_args(n):
                for key in storage_keys(arg):
                    last_write[key] = max(last_write.get(key, -1), index[n])

    layer_nodes = layer_forward_nodes(gm)
    forced: dict[torch.fx.Node, str] = {}
    for n in layer_nodes:
        region = node_meta.layer_id(n)
        if node_meta.is_random(n):
            forced[n] = "random op"
        elif is_mutating(n):
            forced[n] = "in-place op"
        elif is_all_to_all_or_its_wait(n):
            forced[n] = "all-to-all"
        elif any(last_write.get(k, -1) > index[n] for k in storage_keys(n)):
            forced[n] = "written in place later"
        elif any(last_write.get(k, -1) > index[n] for a in n.all_input_nodes for k in storage_keys(a)):
            forced[n] = "reads a tensor written in place later"
        elif any(u.op == "output" or (node_meta.is_forward(u) and node_meta.layer_id(u) != region) for u in n.users):
            forced[n] = "layer boundary"
    return StepStructure(layer_nodes, forced)


# --------------------------------------------------------------------------- policies

Decisions = dict[torch.fx.Node, CheckpointPolicy]


def policy_full(structure: StepStructure, layers: set[int] | None = None) -> Decisions:
    """Recompute every op in the given layers (default: all), attention included; save everything in the others."""
    return {n: RECOMPUTE if layers is None or node_meta.layer_id(n) in layers else SAVE for n in structure.layer_nodes}


def policy_every_nth_layer(structure: StepStructure, n_th: int) -> Decisions:
    """Full recompute of layers N-1, 2N-1, ... (every N-th layer counting from 1), as eager does."""
    layers = {i for i in structure.layers() if (i + 1) % n_th == 0}
    return policy_full(structure, layers)


def _is_sequence_scatter(node: torch.fx.Node) -> bool:
    """A node of a tensor-parallel reduce-scatter along the sequence (after a row-parallel matmul)."""
    tag = node_meta.collective(node)
    return tag is not None and tag["role"] == node_meta.SEQ_SCATTER


def policy_selective_op(structure: StepStructure) -> Decisions:
    """Save matmul, attention and MoE routing outputs (grouped matmuls, permutation, top-k), but recompute every
    second (plain) matmul of each layer; recompute the rest.

    Tensor parallelism: the reduce-scatters' outputs (1/tp of the tokens; redoing one costs a collective) are
    saved, as torchtitan's op-level policy does; the all-gathers along the sequence (tp times bigger) are
    recomputed, i.e. gathered again in the backward, as Megatron's sequence parallelism does.
    """
    decisions: Decisions = {}
    for nodes in structure.layers().values():
        matmuls = 0  # restarts at each layer
        for n in nodes:
            if _is_sequence_scatter(n):
                decisions[n] = SAVE
            elif is_matmul(n.target):
                matmuls += 1
                decisions[n] = RECOMPUTE if matmuls % 2 == 0 else SAVE
            elif is_attention(n.target) or is_routing(n.target):
                decisions[n] = SAVE
            else:
                decisions[n] = RECOMPUTE
    return decisions


def apply_overrides(
    structure: StepStructure, decisions: Decisions, save: list[OpPattern], recompute: list[OpPattern]
) -> Decisions:
    """Per-op overrides win over the policy (save_list over recompute_list); boundaries stay saved.

    Raises:
        ConfigError: a recompute_list entry matches an op that can never be recomputed.
    """
    out = dict(decisions)
    for n in structure.layer_nodes:
        if any(p.matches(n) for p in save):
            out[n] = SAVE
        elif hit := next((p for p in recompute if p.matches(n)), None):
            reason = structure.forced.get(n)
            if reason in ("random op", "in-place op"):
                raise ConfigError(
                    f"activation_checkpoint.recompute_list entry {hit.text!r} matches "
                    f"{n.target} in {node_meta.module_fqn(n)!r}, a {reason} that is never "
                    "recomputed; remove the entry or restrict it with a module glob"
                )
            out[n] = RECOMPUTE
    return out


def finalize(structure: StepStructure, decisions: Decisions) -> Decisions:
    """Force the saves of `structure` and make getitems follow their multi-output parent."""
    out = dict(decisions)
    for n in structure.layer_nodes:
        if n in structure.forced:
            out[n] = SAVE
        elif n.target is operator.getitem and n.args[0] in out:
            out[n] = out[n.args[0]]
    return out


def write_tags(gm: torch.fx.GraphModule, structure: StepStructure, decisions: Decisions) -> None:
    """Write `recompute` and `ac_graph_id` on the layer ops in `decisions`; clear any stale tag elsewhere."""
    layer_set = set(structure.layer_nodes)
    for n in gm.graph.nodes:
        if n in layer_set and n in decisions:
            n.meta[node_meta.RECOMPUTE] = decisions[n]
            n.meta[node_meta.AC_GRAPH_ID] = node_meta.layer_id(n) + 1
        else:
            n.meta.pop(node_meta.RECOMPUTE, None)
            n.meta.pop(node_meta.AC_GRAPH_ID, None)


def policy_for(ac: ActivationCheckpointConfig) -> Callable[[StepStructure], Decisions]:
    """The base policy of a non-budget mode."""
    if ac.mode == "full":
        return policy_full
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        return policy_selective_op
    if ac.mode == "selective":
        return lambda s: policy_every_nth_layer(s, int(ac.selective_ac_option))
    raise ValueError(f"no tagging policy for activation_checkpoint.mode {ac.mode!r}")


# The `full` pass's choices for attention's outputs, in the order a tie is broken: saving costs no FLOPs.
ATTENTION_CHOICES = ("save", "recompute")


def attention_choices(ac: ActivationCheckpointConfig) -> tuple[str, ...]:
    """The choices the pass compares for attention's outputs under `ac` (`ATTENTION_CHOICES`), or none: another
    mode than `full`, or a recompute_list that pins attention already. The planner plans each choice pinned
    (`pin_attention`) and chooses at the model's depth as the pass would (`choose_attention`)."""
    pinned = any("attention" in p for p in ac.recompute_list)
    return ATTENTION_CHOICES if ac.mode == "full" and not pinned else ()


def pin_attention(ac: ActivationCheckpointConfig, choice: str) -> ActivationCheckpointConfig:
    """`ac` (a copy) with attention's outputs pinned to `choice`: the pass then makes that choice without comparing."""
    ac = copy.deepcopy(ac)
    pins = ac.save_list if choice == "save" else ac.recompute_list
    pins.extend(f"aten.{packet.__name__}" for packet in sorted(ATTENTION_OPS, key=str))
    return ac


def choose_attention(peaks: dict[str, int]) -> str:
    """The choice (of `ATTENTION_CHOICES`) whose graph peaks lower; saving on a tie."""
    return min(ATTENTION_CHOICES, key=lambda choice: (peaks[choice], ATTENTION_CHOICES.index(choice)))


def _attention_options(
    structure: StepStructure, decisions: Decisions, ac: ActivationCheckpointConfig
) -> dict[str, Decisions]:
    """The tags of each attention choice (`ATTENTION_CHOICES`) the `full` pass compares, or {} when it has none:
    another mode, or no (non-random) attention op to recompute that the user did not pin (`ac.recompute_list`)."""
    if ac.mode != "full":
        return {}
    _, recompute = parse_overrides(ac.save_list, ac.recompute_list)
    attention = [
        n
        for n in structure.layer_nodes
        if is_attention(n.target) and decisions[n] == RECOMPUTE and not any(p.matches(n) for p in recompute)
    ]
    if not attention:
        return {}
    return {"save": finalize(structure, {**decisions, **{n: SAVE for n in attention}}), "recompute": decisions}


def _decisions(structure: StepStructure, ac: ActivationCheckpointConfig) -> Decisions:
    """The policy of `ac`'s mode with its overrides, made final (before any choice the pass compares)."""
    save, recompute = parse_overrides(ac.save_list, ac.recompute_list)
    return finalize(structure, apply_overrides(structure, policy_for(ac)(structure), save, recompute))


def compared_graphs(gm: torch.fx.GraphModule, ac: ActivationCheckpointConfig) -> dict[str, torch.fx.Graph]:
    """The graphs the `full` pass compares for attention, by choice: `gm` (as the pass receives it) tagged with
    each choice and rematerialized, whose estimated peaks decide (`choose_attention`); {} when it compares none.
    `gm`'s tags are cleared afterwards. The planner reads these at its short depths and extends their peaks."""
    structure = analyze(gm)
    graphs = {}
    options = _attention_options(structure, _decisions(structure, ac), ac)
    for choice, option in options.items():
        write_tags(gm, structure, option)
        graphs[choice] = remat_graph(gm.graph) or copy_graph(gm.graph)
    write_tags(gm, structure, {})
    return graphs


def tag_activation_checkpoint(
    gm: torch.fx.GraphModule, ac: ActivationCheckpointConfig, *, input_categories: list[str] | None = None
) -> torch.fx.GraphModule:
    """Tag the layer ops of `gm` with save/recompute for mode selective or full (see module docstring).

    In `full` mode, saving or recomputing the (non-random) attention outputs is
    decided on the graph: whichever gives the lower estimated peak after remat
    (saving on a tie, as it costs no FLOPs), unless `recompute_list` pins them. Shallow models peak lower
    with them saved, deep ones with them recomputed. In place; returns `gm`. Preserves
    numerics bitwise (metadata only).
    """
    structure = analyze(gm)
    decisions = _decisions(structure, ac)
    # An attention op the user pinned (save_list / recompute_list) keeps its pin: the planner pins each choice to
    # plan it at any depth (`pin_attention`).
    options = _attention_options(structure, decisions, ac)
    if options:
        peaks = {}
        for choice, option in options.items():
            write_tags(gm, structure, option)
            peaks[choice] = peak_after_remat(gm, input_categories)
        decisions = options[choose_attention(peaks)]
    write_tags(gm, structure, decisions)
    warn_if_nothing_recomputed(gm, ac.mode, structure, decisions)
    return gm


def warn_if_nothing_recomputed(
    gm: torch.fx.GraphModule, mode: str, structure: StepStructure, decisions: Decisions
) -> None:
    """Warn when a selective/full plan frees no activation: it then saves what mode 'none' saves,
    which would otherwise go unnoticed (e.g. when the model's transformer layers were not found).

    A recomputed op frees memory only if its output storage is not also held by an op that is
    not recomputed (a saved view of it, an input it is a view of), so such ops do not count.
    """
    kept = {k for n in gm.graph.nodes if decisions.get(n) != RECOMPUTE for k in storage_keys(n)}
    if any(d == RECOMPUTE and not set(storage_keys(n)) <= kept for n, d in decisions.items()):
        return
    why = (
        "no transformer layers were found in the model"
        if not structure.layer_nodes
        else f"every tensor made in the layers ({len(structure.layer_nodes)} ops) stays saved"
    )
    logger.warning(
        f"activation_checkpoint.mode = {mode!r} recomputes nothing, so it saves no memory over "
        f"'none': {why}; if the model's blocks are elsewhere, name their container "
        "(trace_step(..., layers='model.layers'))"
    )


def policy_name(node: torch.fx.Node) -> str:
    """'save', 'recompute' or 'no-AC' for a node, for the saved-activation report."""
    policy = node.meta.get(node_meta.RECOMPUTE)
    if policy is None:
        return "no-AC"
    return "save" if policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE) else "recompute"
