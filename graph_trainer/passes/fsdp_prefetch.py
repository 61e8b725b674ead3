"""FSDP prefetch: issue each unit's all-gather as soon as the previous one has arrived.

Reads the collective tag (`node_meta.gathered_unit`: which unit's parameter
gather a node belongs to, whoever made it) and `custom["rematerialized"]` (the
backward's re-gathers are remat's copies), so it runs after `remat`. Within the forward,
and separately within the backward's re-gathers, the i-th all-gather (with the
nodes that fill its send slot: the empty buffer, the shards' copy into it) is
moved to just after the wait of the (i-1)-th. The collective then runs on the
backend's thread while the previous unit computes; its wait stays where it was,
just before the first use. One gather is in flight at a time, so a rank holds
at most one unit's gathered parameters more than without prefetch (the memory
estimate, run on the final graph, counts them). `prefetch_reserve` measures that
unit on the graph before the pass, for the budget policy, which decides earlier.

Each moved node is marked with the unit it now follows (`node_meta.PREFETCHED_AFTER`):
it runs in that unit's block, where the blocks before hold what their memory
policy saved, and the depth-free plan keys it there (`plan.step_plan.running_blocks`).

Only the position of gather-issuing nodes changes: they read nothing but the
parameter shards, which nothing writes before the optimizer update, so the
pass preserves numerics bitwise. The order of collectives is the same on every
rank (every rank runs the same graph).
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import torch.fx

from graph_trainer.tracer import node_meta
from graph_trainer.tracer.graph_utils import is_all_gather, is_wait
from graph_trainer.tracer.memory_estimate import storage_lifetimes


def _issue_chain(gather: torch.fx.Node) -> list[torch.fx.Node]:
    """The gather and the FSDP-tagged nodes that prepare its buffers, in graph order."""
    unit = node_meta.gathered_unit(gather)
    chain, stack = {gather}, list(gather.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in chain or n.op != "call_function" or node_meta.gathered_unit(n) != unit:
            continue
        chain.add(n)
        stack.extend(n.all_input_nodes)
    # Ops that write into the buffers (the shards' copy) use them without being inputs of the gather.
    for n in list(chain):
        for user in n.users:
            if (
                user not in chain
                and node_meta.gathered_unit(user) == unit
                and user.op == "call_function"
                and any(u is gather for u in user.users)
            ):
                chain.add(user)
    order = {n: i for i, n in enumerate(gather.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def _wait_of(gather: torch.fx.Node) -> torch.fx.Node:
    return next(u for u in gather.users if is_wait(u))


def _unit_gathers(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if is_all_gather(n) and node_meta.gathered_unit(n) is not None]


def prefetch_reserve(gm: torch.fx.GraphModule) -> int:
    """The most bytes the pass can add to `gm`'s peak: the largest unit's issue chain (its gathered buffer and send
    slot), allocated by the estimate's count.

    The pass moves chain i up to the wait of gather i - 1, which comes before chain i's own place, and chain i + 1
    up to the wait of gather i, which comes after it: the stretches a chain is alive early never overlap, and no
    free moves. So at any node the moved graph holds at most one chain more than `gm` tagged the same way, and a
    budget decided before the pass holds after it if it was solved this much below (`passes/budget.py`). Read on
    the forward's gathers: the backward's re-gathers are remat's copies of them, the same bytes."""
    _, allocations = storage_lifetimes(gm, None)
    made_by = Counter()
    for a in allocations:
        made_by[a.producer] += a.nbytes
    return max((sum(made_by[n] for n in _issue_chain(g)) for g in _unit_gathers(gm)), default=0)


def prefetch_fsdp_gathers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Move each FSDP all-gather up to just after the previous one's wait (see the module docstring)."""
    gathers = _unit_gathers(gm)
    for rematerialized in (False, True):
        group = [g for g in gathers if node_meta.is_rematerialized(g) == rematerialized]
        for previous, gather in pairwise(group):
            anchor = _wait_of(previous)
            for n in _issue_chain(gather):
                anchor.append(n)
                anchor = n
                node_meta.custom(n)[node_meta.PREFETCHED_AFTER] = node_meta.gathered_unit(previous)
    gm.recompile()
    return gm


__all__ = ["prefetch_fsdp_gathers", "prefetch_reserve"]
