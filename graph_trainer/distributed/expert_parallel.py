"""Expert parallelism (`parallelism.ep`): each rank holds n_routed_experts / ep routed experts, tokens travel.

The model family names its routed-expert modules (`ParallelPlan.routed_experts`): each holds every expert's
weights stacked along dim 0 and runs `forward(rows, offsets)` on rows sorted by expert. This parallelism
keeps rank r's block of dim 0 (experts r*L .. (r+1)*L - 1, L = n / ep) as the module's own parameters, under
their usual names, and wraps the module's forward on the instance:

1. dispatch: the sorted rows are contiguous per destination rank. Each destination gets a buffer of exactly
   `capacity = ceil(ep_capacity_factor * rows / ep)` rows (zero rows pad it), so the all-to-all has static,
   equal split sizes and the step stays one static graph (no `.item()`, no host sync). Rows beyond a
   destination's capacity are dropped: their expert output is zero. They are counted into the module's
   `ep_dropped_tokens` buffer (logged as moe/dropped_tokens), never silently. A factor of ep never drops.
2. the local experts run on the received rows (re-sorted by local expert; padding rows are zero, and a
   SwiGLU expert maps a zero row to a zero row with a zero gradient, so they change nothing);
3. combine: the reverse all-to-all brings each row's output back to its slot, and the slots back to rows.

Both all-to-alls are `AllToAll`, an autograd Function whose backward is the same all-to-all (an all-to-all
with equal splits is its own transpose), so the backward is traced into the step graph too; each node carries
the collective tag (kind "ep", role dispatch or combine, the layer). Eagerly the very same ops run, so the
eager and traced EP steps agree bitwise.

Gradients: a rank's expert weights see every rank's tokens through the all-to-alls, so their gradient is the
sum over the ranks' losses; dividing it by the data-parallel degree gives the mean over ranks that FSDP's
reduce-scatter gives every other parameter. Expert weights are not FSDP-sharded (ep = dp_shard for now).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from graph_trainer.distributed.mesh import EP, Mesh
from graph_trainer.distributed.parallelism import Parallelism
from graph_trainer.errors import UserError
from graph_trainer.tracer import node_meta

c10d = torch.ops._c10d_functional
KIND = "ep"
DROPPED = "ep_dropped_tokens"  # the experts module's buffer: rows dropped over capacity by the last training step
EXPERT_PARALLEL = "expert_parallel"  # attribute set on the parameters this parallelism holds (FSDP leaves them)


@dataclasses.dataclass(frozen=True)
class EPGroup:
    """The ranks that share one set of experts between them: this rank's index, their number, the group name."""

    rank: int
    size: int
    group_name: str
    data_parallel: int  # the ranks whose losses are averaged (the expert gradients' divisor)


class AllToAll(torch.autograd.Function):
    """An all-to-all of `x` in `size` equal row blocks; its backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, group: EPGroup, tag: dict, back_tag: dict, x: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.back_tag = group, back_tag
        with fx_traceback.annotate({node_meta.COLLECTIVE: tag}):
            return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with fx_traceback.annotate({node_meta.COLLECTIVE: ctx.back_tag}):
            return None, None, None, _all_to_all(grad.contiguous(), ctx.group)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (the expert weights' mean over the data-parallel ranks)."""

    @staticmethod
    def forward(ctx: Any, scale: float, x: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return None, grad * ctx.scale


def _all_to_all(x: torch.Tensor, group: EPGroup) -> torch.Tensor:
    splits = [x.shape[0] // group.size] * group.size
    return c10d.wait_tensor(c10d.all_to_all_single(x, splits, splits, group.group_name))


def capacity(rows: int, ep: int, factor: float) -> int:
    """Rows each rank sends to each destination rank: ceil(factor * rows / ep), at most `rows`."""
    return min(rows, math.ceil(factor * rows / ep))


@dataclasses.dataclass(frozen=True)
class Slots:
    """Where the sorted rows go in the dispatch buffer of `ep` blocks of `cap` slots, and back."""

    row_of_slot: torch.Tensor  # [ep*cap] the row each slot carries (0 for an empty slot)
    slot_valid: torch.Tensor  # [ep*cap] bool: the slot carries a row
    local_expert: torch.Tensor  # [ep*cap] the slot's expert, numbered on its destination rank
    slot_of_row: torch.Tensor  # [rows] the slot each row went to (0 for a dropped row)
    kept: torch.Tensor  # [rows] bool: the row fit in its destination's capacity


def plan_slots(offsets: torch.Tensor, rows: int, ep: int, cap: int) -> Slots:
    """The dispatch layout of `rows` rows sorted by expert (`offsets`: cumulative row ends per expert)."""
    ends = offsets.to(torch.int64)
    local = ends.shape[0] // ep
    idx = torch.arange(rows, device=ends.device)
    expert_of_row = torch.searchsorted(ends, idx, right=True).clamp(max=ends.shape[0] - 1)
    rank_end = ends[local - 1 :: local]  # [ep] the end row of each destination's block
    rank_start = torch.cat([rank_end.new_zeros(1), rank_end[:-1]])
    dest = expert_of_row // local
    pos = idx - rank_start[dest]
    kept = pos < cap
    slot_of_row = torch.where(kept, dest * cap + pos, 0)
    slot_pos = torch.arange(cap, device=ends.device)
    row_of_slot = (rank_start.unsqueeze(1) + slot_pos).flatten()  # [ep*cap]
    slot_valid = (slot_pos < (rank_end - rank_start).unsqueeze(1)).flatten()
    row_of_slot = torch.where(slot_valid, row_of_slot, 0)
    dest_of_slot = torch.arange(ep, device=ends.device).repeat_interleave(cap)
    # An empty slot is a zero row: any expert maps it to zero; the last one keeps the sort simple.
    local_expert = torch.where(slot_valid, expert_of_row[row_of_slot] - dest_of_slot * local, local - 1)
    return Slots(row_of_slot, slot_valid, local_expert, slot_of_row, kept)


def _ep_forward(experts: nn.Module, group: EPGroup, factor: float, layer: int | None, inner: Callable, rows, offsets):
    """The wrapped forward of a routed-experts module: dispatch, local experts, combine (module docstring)."""
    cap = capacity(rows.shape[0], group.size, factor)
    slots = plan_slots(offsets, rows.shape[0], group.size, cap)
    _count_dropped(experts, slots.kept)
    tag = functools.partial(node_meta.collective_tag, KIND, layer=layer)
    send = rows.index_select(0, slots.row_of_slot) * slots.slot_valid.unsqueeze(-1).to(rows.dtype)
    recv = AllToAll.apply(group, tag(node_meta.DISPATCH), tag(node_meta.DISPATCH), send)
    with fx_traceback.annotate({node_meta.COLLECTIVE: tag(node_meta.DISPATCH)}):
        recv_expert = _all_to_all(slots.local_expert, group)
    order = recv_expert.argsort(stable=True)
    local = next(iter(experts._parameters.values())).shape[0]
    counts = torch.zeros(local, dtype=torch.int64, device=rows.device).scatter_add(
        0, recv_expert, torch.ones_like(recv_expert)
    )
    with _mean_gradients(experts, group.data_parallel):
        out_sorted = inner(recv.index_select(0, order), counts.cumsum(0).to(torch.int32))
    out = out_sorted.index_select(0, order.argsort())
    back = AllToAll.apply(group, tag(node_meta.COMBINE), tag(node_meta.COMBINE), out)
    return back.index_select(0, slots.slot_of_row) * slots.kept.unsqueeze(-1).to(back.dtype)


class _mean_gradients:
    """Within: the module's parameters read through `ScaleGrad(1 / n)` (their gradient becomes a mean over n)."""

    def __init__(self, module: nn.Module, n: int):
        self.module, self.n = module, n

    def __enter__(self) -> None:
        self.saved = dict(self.module._parameters)
        for name, p in self.saved.items():
            self.module._parameters[name] = ScaleGrad.apply(1.0 / self.n, p)

    def __exit__(self, *exc: Any) -> None:
        self.module._parameters.update(self.saved)


@torch.no_grad()
def _count_dropped(experts: nn.Module, kept: torch.Tensor) -> None:
    """Set the module's dropped-row count from this training forward (not again when a backward recomputes it)."""
    if experts.training and torch._C._current_graph_task_id() == -1:
        getattr(experts, DROPPED).copy_((~kept).sum())


def _experts_modules(model: nn.Module, suffix: str) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if suffix and (n == suffix or n.endswith("." + suffix))]


def _layer_of(name: str, layers: str) -> int | None:
    """The layer index in '<layers>.<i>.moe.experts', or None."""
    parts = name.split(".")
    head = layers.split(".")
    if parts[: len(head)] == head and len(parts) > len(head) and parts[len(head)].isdigit():
        return int(parts[len(head)])
    return None


def dropped_tokens(model: nn.Module) -> torch.Tensor | None:
    """Rows dropped over capacity by the last training step on this rank, summed over layers (None: no EP)."""
    found = [b for n, b in model.named_buffers() if n.endswith(DROPPED)]
    return torch.stack(found).sum() if found else None


class ExpertParallel(Parallelism):
    """Routed experts split over the mesh's `ep` dimension (see the module docstring)."""

    kind = KIND
    label = "EP"

    def __init__(self, model: nn.Module, group: EPGroup, full: dict[str, torch.Size]):
        self.model, self.group, self._full = model, group, full

    @classmethod
    def apply(cls, model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> ExpertParallel | None:
        """None when ep is 1.

        Raises:
            UserError: ep > 1 on a model without routed experts, an ep that does not divide their number, or
                ep below dp_shard (expert weights FSDP-sharded over dp_shard / ep is not implemented yet).
        """
        ep = mesh.size(EP)
        if ep == 1:
            return None
        suffix = getattr(plan, "routed_experts", "")
        if not suffix:
            raise UserError(f"parallelism.ep = {ep} but this model has no routed experts; use --parallelism.ep 1")
        found = _experts_modules(model, suffix)
        if not found:  # a family with experts, built too shallow to reach its MoE layers (the planner's short models)
            return None
        if ep != mesh.size("dp_shard"):
            raise UserError(
                f"parallelism.ep = {ep} below parallelism.dp_shard = {mesh.size('dp_shard')} (expert weights "
                "FSDP-sharded over dp_shard / ep) is not supported yet; set --parallelism.ep equal to dp_shard"
            )
        n = next(found[0][1].parameters()).shape[0]
        if n % ep:
            raise UserError(
                f"parallelism.ep = {ep} does not divide the {n} routed experts; pick an ep that divides {n}"
            )
        pg = mesh.group(EP)
        group = EPGroup(dist.get_rank(pg), ep, pg.group_name, mesh.data_size)
        factor = cfg.parallelism.ep_capacity_factor
        full = {}
        for name, experts in found:
            full.update(_split_experts(name, experts, group))
            inner = type(experts).forward.__get__(experts)
            layer = _layer_of(name, plan.layers)
            experts.forward = functools.partial(_ep_forward, experts, group, factor, layer, inner)
        return cls(model, group, full)

    def full_shapes(self) -> dict[str, torch.Size]:
        return dict(self._full)

    def local_slices(self, name: str, local: torch.Tensor) -> tuple[slice, ...] | None:
        full = self._full.get(name)
        if full is None:
            return None
        rows = full[0] // self.group.size
        return (slice(self.group.rank * rows, (self.group.rank + 1) * rows), *(slice(0, n) for n in full[1:]))

    def full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with every expert weight gathered whole (a collective over the ep ranks)."""
        out = dict(state)
        with torch.no_grad():
            for name in self._full:
                local = state[name].detach().contiguous()
                out[name] = c10d.wait_tensor(c10d.all_gather_into_tensor(local, self.group.size, self.group.group_name))
        return out


def _split_experts(prefix: str, experts: nn.Module, group: EPGroup) -> dict[str, torch.Size]:
    """Keep this rank's block of every stacked expert weight of `experts`, in place; their full shapes by name."""
    full = {}
    for attr, p in list(experts._parameters.items()):
        rows = p.shape[0] // group.size
        local = nn.Parameter(p.detach()[group.rank * rows : (group.rank + 1) * rows].clone(), p.requires_grad)
        setattr(local, EXPERT_PARALLEL, True)
        experts._parameters[attr] = local
        full[f"{prefix}.{attr}"] = p.shape
    experts.register_buffer(DROPPED, torch.zeros((), dtype=torch.float32, device=p.device), persistent=False)
    return full


__all__ = ["DROPPED", "EXPERT_PARALLEL", "AllToAll", "ExpertParallel", "capacity", "dropped_tokens", "plan_slots"]
