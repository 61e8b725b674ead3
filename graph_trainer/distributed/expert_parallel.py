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

With ep below dp_shard the experts are FSDP-sharded too, over the mesh's derived `dp_shard_mod_ep` dimension
(the S = dp_shard / ep ranks that share an ep index): each of the dp_shard ranks holds n / dp_shard whole experts
(a "block"), and its ep rank's n / ep experts are the S blocks of its `dp_shard_mod_ep` peers, all-gathered
inside the experts' forward (`fsdp.FSDP.gathered`, one unit per experts module, tagged as FSDP's gathers are;
its backward reduce-scatters). Rank r of dp_shard (r = s * ep + e: the mesh lays ep innermost) holds the
experts r * block .. (r + 1) * block - 1, so every rank's part is its `Shard(0)` row block over dp_shard whatever
the ep, and checkpoints reshard between any ep (and dp_shard) that divide the experts. Expert x therefore lives
on ep rank (x // block) % ep, as local expert (x // (block * ep)) * block + x % block: the blocks are dealt to the
ep ranks in turn, which `plan_slots` follows. With ep = dp_shard, S is 1 and each rank holds one contiguous block.

Gradients: a rank's expert weights see the tokens of its ep group through the all-to-alls, so their gradient is
the sum over those ranks' losses; the reduce-scatter over the S blocks' holders sums the ep groups and divides by
S, and dividing by ep first gives the mean over the data-parallel ranks that FSDP gives every other parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
import torch.nn as nn

from graph_trainer.distributed.fsdp import EXPERT_PARALLEL, FSDP, ShardGroup, Unit
from graph_trainer.distributed.mesh import EP, EXPERT_SHARD, Mesh
from graph_trainer.distributed.parallelism import Parallelism
from graph_trainer.errors import UserError
from graph_trainer.observability.log import get_logger
from graph_trainer.runtime.device import DTYPES
from graph_trainer.tracer import node_meta

logger = get_logger(__name__)

c10d = torch.ops._c10d_functional
KIND = "ep"
DROPPED = "ep_dropped_tokens"  # the experts module's buffer: rows dropped over capacity by the last training step
HOLDERS = "dp_shard"  # the mesh dimension whose ranks each hold one block of every experts module


@dataclasses.dataclass(frozen=True)
class EPGroup:
    """The ranks that share one set of experts between them: this rank's index, their number, the group name."""

    rank: int
    size: int
    group_name: str
    grad_divisor: int  # the gathered experts' gradient is divided by it before the reduce-scatter (mean over ranks)
    block: int  # experts each dp_shard rank holds: the ep ranks are dealt blocks of this many in turn


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


def plan_slots(offsets: torch.Tensor, rows: int, ep: int, cap: int, block: int | None = None) -> Slots:
    """The dispatch layout of `rows` rows sorted by expert (`offsets`: cumulative row ends per expert).

    `block`: the experts are dealt to the `ep` ranks in blocks of this many, in turn (the module docstring);
    None: one contiguous block of n / ep per rank. A destination's rows keep their order (by expert).
    """
    ends = offsets.to(torch.int64)
    n, device = ends.shape[0], ends.device
    block = block or n // ep
    local = n // ep  # experts per destination: n / (block * ep) rounds of `block`
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    start = ends - counts  # each expert's first row
    by_dest = counts.view(-1, ep, block).transpose(0, 1).reshape(ep, local)  # [ep, local] in each one's order
    dest_ends = by_dest.cumsum(1)
    dest_starts = dest_ends - by_dest
    local_ids = torch.arange(local, device=device)
    dest_ids = torch.arange(ep, device=device).unsqueeze(1)
    expert_of_local = ((local_ids // block) * ep + dest_ids) * block + local_ids % block  # [ep, local]

    idx = torch.arange(rows, device=device)
    expert_of_row = torch.searchsorted(ends, idx, right=True).clamp(max=n - 1)
    dest = (expert_of_row // block) % ep
    local_of_row = (expert_of_row // (block * ep)) * block + expert_of_row % block
    pos = dest_starts[dest, local_of_row] + idx - start[expert_of_row]
    kept = pos < cap
    slot_of_row = torch.where(kept, dest * cap + pos, 0)

    slot_pos = torch.arange(cap, device=device).expand(ep, cap).contiguous()
    slot_valid = slot_pos < dest_ends[:, -1:]  # [ep, cap]
    local_of_slot = torch.searchsorted(dest_ends, slot_pos, right=True).clamp(max=local - 1)
    row_of_slot = start[expert_of_local.gather(1, local_of_slot)] + slot_pos - dest_starts.gather(1, local_of_slot)
    row_of_slot = torch.where(slot_valid, row_of_slot, 0).flatten()
    # An empty slot is a zero row: any expert maps it to zero; the last one keeps the sort simple.
    local_expert = torch.where(slot_valid, local_of_slot, local - 1).flatten()
    return Slots(row_of_slot, slot_valid.flatten(), local_expert, slot_of_row, kept)


def _ep_forward(
    experts: nn.Module,
    group: EPGroup,
    factor: float,
    layer: int | None,
    inner: Callable,
    gathered: Callable[[], Any],
    rows: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """The wrapped forward of a routed-experts module: dispatch, local experts (`gathered`: their weights whole
    inside it), combine (module docstring)."""
    cap = capacity(rows.shape[0], group.size, factor)
    slots = plan_slots(offsets, rows.shape[0], group.size, cap, group.block)
    _count_dropped(experts, slots.kept)
    tag = functools.partial(node_meta.collective_tag, KIND, layer=layer)
    send = rows.index_select(0, slots.row_of_slot) * slots.slot_valid.unsqueeze(-1).to(rows.dtype)
    recv = AllToAll.apply(group, tag(node_meta.DISPATCH), tag(node_meta.DISPATCH), send)
    with fx_traceback.annotate({node_meta.COLLECTIVE: tag(node_meta.DISPATCH)}):
        recv_expert = _all_to_all(slots.local_expert, group)
    order = recv_expert.argsort(stable=True)
    local = offsets.shape[0] // group.size
    counts = torch.zeros(local, dtype=torch.int64, device=rows.device).scatter_add(
        0, recv_expert, torch.ones_like(recv_expert)
    )
    with gathered(), _mean_gradients(experts, group.grad_divisor):
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
    """The routed-expert modules named `*.<suffix>` that hold their weights (another pipeline stage's, removed from
    this rank's model, hold none)."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if suffix and (n == suffix or n.endswith("." + suffix)) and next(m.parameters(), None) is not None
    ]


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
    """Routed experts split over the mesh's `ep` dimension, FSDP-sharded over the rest of dp_shard (see above)."""

    kind = KIND
    label = "EP"
    mesh_dim = EP
    carved_from = HOLDERS

    @classmethod
    def search_degrees(cls, model_args: Any, host: int) -> list[int]:
        """1, and for a model with routed experts every divisor of dp_shard (`host`) that divides their number."""
        experts = getattr(model_args, "n_routed_experts", 0) or 0
        return [1] + [e for e in range(2, host + 1) if host % e == 0 and experts and experts % e == 0]

    def __init__(self, holders: ShardGroup, block: int, full: dict[str, torch.Size], mesh: Mesh):
        self.holders, self.block, self._full, self.mesh = holders, block, full, mesh

    @classmethod
    def apply(cls, model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> ExpertParallel | None:
        """None when ep is 1.

        Raises:
            UserError: ep > 1 on a model without routed experts, or an ep (or, below it, a dp_shard) that does not
                divide their number.
        """
        ep = mesh.size(EP)
        if ep == 1:
            return None
        why = cls.allows(model, plan, {EP: ep, HOLDERS: mesh.size(HOLDERS)}, cfg.training.seq_len)
        if why is not None:
            raise UserError(why)
        found = _experts_modules(model, plan.routed_experts)
        if not found:  # a family with experts, built too shallow to reach its MoE layers (the planner's short models)
            return None
        n, holders = next(found[0][1].parameters()).shape[0], mesh.size(HOLDERS)
        pg = mesh.group(EP)
        shard = mesh.size(EXPERT_SHARD)  # the ranks whose blocks make up one ep rank's experts
        group = EPGroup(dist.get_rank(pg), ep, pg.group_name, mesh.data_size // shard, n // holders)
        holder_group = ShardGroup.of(mesh.group(HOLDERS))
        full = {}
        for name, experts in found:
            full.update(_split_experts(name, experts, holder_group, group.block))
        fsdp = _expert_fsdp(model, found, mesh, cfg, plan.layers) if shard > 1 else None
        factor = cfg.parallelism.ep_capacity_factor
        for name, experts in found:
            inner = type(experts).forward.__get__(experts)
            gathered = functools.partial(fsdp.gathered, name) if fsdp is not None else contextlib.nullcontext
            layer = _layer_of(name, plan.layers)
            experts.forward = functools.partial(_ep_forward, experts, group, factor, layer, inner, gathered)
        return cls(holder_group, group.block, full, mesh)

    @classmethod
    def allows(cls, block: nn.Module, plan: Any, degrees: Mapping[str, int], seq_len: int) -> str | None:
        """ep needs routed experts (the family's `ParallelPlan.routed_experts`), and ep and dp_shard (the holders of
        the experts' blocks) must divide their number: the stacked weights' first dimension, or for a block built
        too shallow to hold them (the search's one-block model of DeepSeek-V3 is dense) its args' `n_routed_experts`."""
        ep = degrees.get(EP, 1)
        if ep == 1:
            return None
        suffix = getattr(plan, "routed_experts", "")
        found = _experts_modules(block, suffix) if suffix else []
        if found:
            n = next(found[0][1].parameters()).shape[0]
        else:
            n = getattr(getattr(block, "args", None), "n_routed_experts", 0) or 0
        if not suffix or not n:
            return f"parallelism.ep = {ep} but this model has no routed experts; use --parallelism.ep 1"
        return expert_degrees_refusal(n, ep, degrees.get(HOLDERS, 1))

    def step_metrics(self, model: nn.Module) -> dict[str, float]:
        """The (token, expert) rows dropped over capacity this step, summed over every rank and MoE layer (a
        collective), and said once, on rank 0, whenever it is not zero."""
        dropped = dropped_tokens(model)
        if dropped is None:
            return {}
        total = float(self.mesh.global_average(dropped) * self.mesh.world_size)
        if total > 0 and self.mesh.rank == 0:
            logger.warning(
                f"expert parallelism dropped {total:.0f} (token, expert) rows over capacity this step "
                "(raise parallelism.ep_capacity_factor to drop fewer)"
            )
        return {"dropped_tokens": total}

    def full_shapes(self) -> dict[str, torch.Size]:
        return dict(self._full)

    def local_slices(self, name: str, local: torch.Tensor) -> tuple[slice, ...] | None:
        full = self._full.get(name)
        if full is None:
            return None
        start = self.holders.rank * self.block
        return (slice(start, start + self.block), *(slice(0, n) for n in full[1:]))

    def full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with every expert weight gathered whole (a collective over the dp_shard ranks)."""
        out = dict(state)
        g = self.holders
        with torch.no_grad():
            for name in self._full:
                local = state[name].detach().contiguous()
                out[name] = c10d.wait_tensor(c10d.all_gather_into_tensor(local, g.world_size, g.group_name))
        return out


def expert_degrees_refusal(n: int, ep: int, holders: int) -> str | None:
    """Why an ep, or a dp_shard (the blocks' holders), does not split the `n` routed experts, with the fix (None:
    both divide them)."""
    if n % ep:
        return f"parallelism.ep = {ep} does not divide the {n} routed experts; pick an ep that divides {n}"
    if n % holders:
        return (
            f"parallelism.dp_shard = {holders} does not divide the {n} routed experts: with parallelism.ep = {ep} "
            f"each rank holds n_routed_experts / dp_shard whole experts; pick a dp_shard that divides {n} "
            f"(or ep = dp_shard)"
        )
    return None


def _expert_fsdp(model: nn.Module, found: list[tuple[str, nn.Module]], mesh: Mesh, cfg: Any, layers: str) -> FSDP:
    """The FSDP that gathers each (split) experts module's blocks over `dp_shard_mod_ep`: one unit per module."""
    t, shard = cfg.training, mesh.size(EXPERT_SHARD)
    return FSDP(
        model,
        ShardGroup.of(mesh.group(EXPERT_SHARD)),
        [_expert_unit(name, experts, shard, layers) for name, experts in found],
        param_dtype=DTYPES[t.mixed_precision_param],
        reduce_dtype=DTYPES[t.mixed_precision_reduce],
    )


def _expert_unit(name: str, experts: nn.Module, shard: int, layers: str) -> Unit:
    """One gather unit per experts module: its weights' blocks, whole once gathered over `shard` ranks."""
    attrs = list(experts._parameters)
    shapes = [torch.Size([shard * experts._parameters[a].shape[0], *experts._parameters[a].shape[1:]]) for a in attrs]
    slots = [[(experts, a)] for a in attrs]
    return Unit(name, shapes, slots, [f"{name}.{a}" for a in attrs], _layer_of(name, layers))


def _split_experts(prefix: str, experts: nn.Module, holders: ShardGroup, block: int) -> dict[str, torch.Size]:
    """Keep this rank's block of every stacked expert weight of `experts`, in place; their full shapes by name."""
    full = {}
    start = holders.rank * block
    for attr, p in list(experts._parameters.items()):
        local = nn.Parameter(p.detach()[start : start + block].clone(), p.requires_grad)
        setattr(local, EXPERT_PARALLEL, True)
        experts._parameters[attr] = local
        full[f"{prefix}.{attr}"] = p.shape
    experts.register_buffer(DROPPED, torch.zeros((), dtype=torch.float32, device=p.device), persistent=False)
    return full


__all__ = [
    "DROPPED",
    "EXPERT_PARALLEL",
    "AllToAll",
    "ExpertParallel",
    "capacity",
    "expert_degrees_refusal",
    "dropped_tokens",
    "plan_slots",
]
