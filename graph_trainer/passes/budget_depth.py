"""The budget policy for a deep model, solved on its two short traces: one choice per block class, at any depth.

A model of L identical blocks is planned from traces of 3 and 4 blocks (`plan/block_plan.py`); its `budget` plan
is exact when the choice the step runs is the one the plan solved. So on a deep model the policy chooses per
block *class*, as the plan keys blocks: each leading block, the first, the middle ones (one choice for all of
them) and the last. Measured at 6 blocks of the tests' tiny widths (10 budgets from the lowest peak to none) and
at 8 debug blocks (the default budget): the optimum restricted this way recomputes exactly the FLOPs of the
per-op optimum (docs/passes_and_memory.md). A model of 4 blocks or fewer is solved whole,
per op, as before.

The deep model's MILP is the 4-block one (`remat_model.build_model`) with its two middle blocks' choices tied,
and every memory row extended to depth L. Each of the L - 4 middle blocks a 4-block step lacks adds, at a place
of the 4-block step, a constant (its parameters, gradients, what it saves whatever the choice) and, where it sits
between its forward and its backward, its saved activations: the terms of the first middle block's storages at
the first backward op, `F`. So a row becomes row_4 + (L - 4) (c + s F), s in {0, 1}. c and s are read off the 3-
and 4-block models (their difference at every place, under several tied choices) and must explain that
difference exactly under each of them, or the extension is refused (`NotExtendable`) and the plan says so. The
recompute FLOPs extend the same way (the first middle block's copies, L - 4 more times). Every coefficient added is
a positive multiple of a variable the model already bounds from below, so the model stays exact: its optimum is
the optimum over per-class choices at depth L, and its peak under a choice is the deep graph's estimate (tested
against whole traces at 6, 8 and 16 blocks in tests/passes/test_budget_depth.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable

import numpy as np
import torch.fx

from graph_trainer.passes.remat_model import RematModel
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import tensors

Key = tuple[str, int]  # (block class, rank among the block's layer ops)


class NotExtendable(Exception):
    """The short models do not extend in depth exactly; the message says where."""


def block_class(layer: int, depth: int, lead: int) -> str:
    """The class a block's choice is shared by: `lead<i>` for each of the `lead` leading blocks, `first`, `mid`
    (every block between the first and the last), `last`."""
    if layer < lead:
        return f"lead{layer}"
    if layer == lead:
        return "first"
    return "last" if layer == depth - 1 else "mid"


def candidate_keys(candidates: Iterable[torch.fx.Node], depth: int, lead: int) -> dict[torch.fx.Node, Key]:
    """Each candidate's key: its block's class and its rank among that block's candidates (graph order)."""
    ranks: dict[int, int] = {}
    out = {}
    for c in candidates:
        layer = node_meta.layer_id(c)
        out[c] = (block_class(layer, depth, lead), ranks.get(layer, 0))
        ranks[layer] = ranks.get(layer, 0) + 1
    return out


def signature(node: torch.fx.Node) -> str:
    """What a candidate must be for a choice to apply to it: its op and output shapes."""
    return f"{node.target} {[tuple(t.shape) for t in tensors(node.meta.get('val'))]}"


@dataclasses.dataclass(frozen=True)
class BlockChoice:
    """The budget policy's answer for a model `depth` blocks deep, solved on its short traces: the candidates
    recomputed, by key (`candidate_keys`), for the graph whose candidates have `signatures`."""

    depth: int
    recompute: frozenset[Key]
    signatures: tuple[tuple[Key, str], ...]  # every candidate key of a block class and its `signature`
    target_bytes: int
    peak_bytes: int  # the deep graph's estimated peak under this choice
    recompute_flops: int  # at depth `depth`
    recomputed: int  # candidates recomputed at depth `depth`
    candidates: int  # candidates at depth `depth`
    optimal: bool
    gap: float | None
    solve_s: float
    status: str
    short_depths: tuple[int, int]
    lead: int  # leading blocks, each its own class (`block_class`)
    room: str = ""  # what the target left room for beside the graph, in the log's words (`budget.Outside.words`)
    # Solved on one process's step and applied to a pipeline's micro-step (`plan.stage_plan.pipeline_budget_choice`):
    # the deep graph it tags is not the step `peak_bytes` estimates; the stage plan plans each rank's peak.
    micro_step: bool = False

    def decisions(self, keys: dict[torch.fx.Node, Key]) -> set[torch.fx.Node] | str:
        """The candidates of a graph (`keys`: theirs) this choice recomputes, or why it does not apply there."""
        expected = dict(self.signatures)
        for node, key in keys.items():
            if key not in expected:
                return f"its candidate {node.name} ({key[0]} block, rank {key[1]}) was not in the planned graph"
            if signature(node) != expected[key]:
                return f"its candidate {node.name} is {signature(node)}, planned as {expected[key]}"
        if len(set(keys.values())) != len(expected):
            return f"it has {len(set(keys.values()))} candidate keys, the planned graph {len(expected)}"
        return {n for n, k in keys.items() if k in self.recompute}


def extend_in_depth(
    four: RematModel,
    three: RematModel,
    *,
    counterpart: dict[torch.fx.Node, torch.fx.Node],
    block_of: dict[torch.fx.Node, int | None],
    lead: int,
    depth: int,
    samples: int = 4,
) -> RematModel:
    """The model of the `depth`-block step under per-class choices, from the models of its `lead`+4-block step
    (`four`) and `lead`+3-block step (`three`); see the module docstring.

    `counterpart`: each op of the `four` step that has one -> the same op of the `three` step (its block-plan key);
    `block_of`: the block of each op of the `four` step (None outside the blocks). `samples`: random tied choices
    the extension is checked on, besides recomputing nothing and everything.

    Raises:
        NotExtendable: the two models' difference is not one more middle block at some place, or the candidates
            of the two middle blocks differ.
    """
    d4, d3 = lead + 4, lead + 3
    mid = lead + 1  # the 4-block step's first middle block: the one the L - 4 extra blocks repeat
    extra = depth - d4
    keys4 = candidate_keys(four.candidates, d4, lead)
    keys3 = candidate_keys(three.candidates, d3, lead)
    index4 = {c: i for i, c in enumerate(four.candidates)}
    by_key4: dict[Key, list[int]] = {}
    for c, k in keys4.items():
        by_key4.setdefault(k, []).append(index4[c])
    if set(by_key4) != set(keys3.values()) or any(len(v) != (2 if k[0] == "mid" else 1) for k, v in by_key4.items()):
        raise NotExtendable("the short steps' blocks do not have the same candidates")
    ties = [(v[0], v[1]) for k, v in by_key4.items() if k[0] == "mid"]

    def owned_by_mid(v: int) -> bool:
        owner = four.owners[v]
        return owner is not None and block_of.get(owner) == mid

    # F: the first middle block's saved activations, as the first backward op sees them.
    reference = next(p for p, n in enumerate(four.place_nodes) if node_meta.is_backward(n))
    saved = {v: c for v, c in four.memory[reference][0].items() if owned_by_mid(v)}
    mid_flops = np.array([f if owned_by_mid(v) else 0.0 for v, f in enumerate(four.flops)])
    mid_elements = np.array([e if owned_by_mid(v) else 0.0 for v, e in enumerate(four.elements)])

    place3 = {(n, x): p for p, (n, x) in enumerate(zip(three.place_nodes, three.place_copies, strict=True))}
    opposite = []
    for n, x in zip(four.place_nodes, four.place_copies, strict=True):
        there = (counterpart.get(n), None if x is None else counterpart.get(x))
        if there in place3:
            opposite.append(place3[there])
        elif n in counterpart:  # a copy the shorter step has no place for: as the op it precedes
            opposite.append(place3[(counterpart[n], None)])
        else:  # a placeholder: the inputs alone
            opposite.append(0)

    rng = random.Random(0)
    all_keys = sorted(by_key4)
    samples_keys = [set(), set(all_keys)] + [
        {k for k in all_keys if rng.random() < share} for share in np.linspace(0.2, 0.8, samples)
    ]
    keyed3 = {}
    for c, k in keys3.items():
        keyed3.setdefault(k, []).append(c)
    differences, far, flops_ok = [], [], True
    for chosen in samples_keys:
        x4 = four.values([four.candidates[i] for k in chosen for i in by_key4[k]])
        x3 = three.values([c for k in chosen for c in keyed3[k]])
        differences.append(four.row_values(x4) - three.row_values(x3)[opposite])
        far.append(sum(c * x4[v] for v, c in saved.items()))
        flops_ok &= abs((four.flops @ x4 - three.flops @ x3) - mid_flops @ x4) < 0.5
        flops_ok &= abs((four.elements @ x4 - three.elements @ x3) - mid_elements @ x4) < 0.5
    if not flops_ok:
        raise NotExtendable("the recompute FLOPs of one more middle block are not the first middle block's")
    differences_by_place = np.array(differences).T  # [place, sample]
    far_values = np.array(far)
    memory = []
    for p, ((coef, const), g) in enumerate(zip(four.memory, differences_by_place, strict=True)):
        if saved and np.all(np.abs(g - far_values - (g[0] - far_values[0])) < 0.5):
            share, constant = 1.0, g[0] - far_values[0]
        elif np.all(np.abs(g - g[0]) < 0.5):
            share, constant = 0.0, g[0]
        else:
            raise NotExtendable(
                f"at {four.places[p]}, one more middle block adds {sorted(set(g.tolist()))} bytes under the choices "
                "tried: neither a constant nor a constant plus its saved activations"
            )
        row = dict(coef)
        for v, c in saved.items():
            if share:
                row[v] = row.get(v, 0.0) + extra * share * c
        memory.append((row, const + extra * constant))
    return dataclasses.replace(
        four,
        memory=memory,
        flops=four.flops + extra * mid_flops,
        elements=four.elements + extra * mid_elements,
        ties=ties,
    )


__all__ = ["BlockChoice", "Key", "NotExtendable", "block_class", "candidate_keys", "extend_in_depth", "signature"]
