"""Tensor parallelism with sequence parallelism (`parallelism.tp`), Megatron's split of a transformer block.

The model family declares the split (`models.common.spec.TensorParallelPlan`, e.g. models/llama3); this module
applies it in place, with plain local shards and explicit collectives, as FSDP does (no DTensor, no tensor
subclass in the traced graph):

- column-parallel Linears (Llama: wq, wk, wv, w1, w3) keep the rows of their weight that make this rank's
  outputs (its heads, its part of the FFN width); row-parallel ones (wo, w2) keep the matching input columns
  and compute a partial sum;
- each sequence region (attention, feed-forward) is entered through an all-gather of its input along the
  sequence and left through a reduce-scatter of its partial sums along the sequence: between them the norms
  and the residual stream hold 1/tp of the tokens (sequence parallelism);
- the token embedding and the output projection are split by vocabulary, padded to a multiple of tp with
  zero rows (Megatron's rule: the debug vocabulary 258 does not divide by 4). The embedding looks up the ids it
  holds and its output is reduce-scattered along the sequence; the output projection's input is all-gathered
  and its logits stay split: the loss is vocabulary-parallel (`graph_trainer.loss.vocab_parallel`) and masks
  the padding logits;
- the norms' weights are whole on every rank; each rank's gradient covers its tokens only, so the gradients
  are summed over the tp ranks after the backward (`grad_reduce`), and the clip norm counts them once.

Every collective is a `_c10d_functional` op with its `wait_tensor`, called from an autograd.Function whose
backward calls the opposite collective (all-gather <-> reduce-scatter), so eager autograd runs the very ops a
trace records: traced and eager TP agree bitwise. Each node carries the collective tag
(`node_meta.COLLECTIVE`) with kind "tp", a role (`SEQ_GATHER`, `SEQ_SCATTER`, `LOSS_REDUCE`, `GRAD_REDUCE`,
`NORM_REDUCE`), the module it serves as unit and its layer; the node's phase is its own.

Async TP seam: a region's all-gather (its `wait_tensor`) feeds the column-parallel matmuls directly, and the
row-parallel matmul feeds the reduce-scatter directly: a later pass can fuse each pair.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.nn.functional as F

from graph_trainer.distributed.fsdp import ShardGroup
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.distributed.parallelism import Owner, Parallelism, gradient_owners, owned_by
from graph_trainer.distributed.vocab_parallel import VocabParallelLoss
from graph_trainer.errors import UserError
from graph_trainer.loss import vocab_parallel
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.layers import transformer_layers

c10d = torch.ops._c10d_functional
KIND = "tp"
MESH_DIM = "tp"
COLUMN, ROW = 0, 1  # the weight dimension a Linear is split along


# --------------------------------------------------------------------------- collectives along the sequence


def _wait(t: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(t)


def _gather_seq(x: torch.Tensor, g: ShardGroup) -> torch.Tensor:
    """[B, s, ...] on each rank -> [B, s * tp, ...], the ranks' parts in rank order (dim 0 gathered, so the
    sequence is moved in front and back).

    The result is made contiguous once (a copy only when B > 1): each Linear reading a strided view would copy
    it for its matmul and keep its own copy for the backward (three for q, k and v)."""
    front = x.movedim(1, 0).contiguous()
    return _wait(c10d.all_gather_into_tensor(front, g.world_size, g.group_name)).movedim(0, 1).contiguous()


def _scatter_seq(x: torch.Tensor, g: ShardGroup) -> torch.Tensor:
    """[B, S, ...] partial sums on each rank -> this rank's [B, S / tp, ...] part of their sum."""
    front = x.movedim(1, 0).contiguous()
    return _wait(c10d.reduce_scatter_tensor(front, "sum", g.world_size, g.group_name)).movedim(0, 1)


class SeqCollective(torch.autograd.Function):
    """All-gather along the sequence (`gather`) or reduce-scatter of partial sums along it (not `gather`) in the
    forward; the other one on the gradient in the backward (tagged with `backward_tag`)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ShardGroup, gather: bool, backward_tag: dict[str, Any]
    ) -> torch.Tensor:
        ctx.group, ctx.gather, ctx.tag = group, gather, backward_tag
        return (_gather_seq if gather else _scatter_seq)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with fx_traceback.annotate({node_meta.COLLECTIVE: ctx.tag}):
            return (_scatter_seq if ctx.gather else _gather_seq)(grad, ctx.group), None, None, None


def _tagged(role: str, unit: str, layer: int | None) -> contextlib.AbstractContextManager:
    return fx_traceback.annotate({node_meta.COLLECTIVE: node_meta.collective_tag(KIND, role, unit, layer)})


def gather_sequence(x: torch.Tensor, group: ShardGroup, unit: str, layer: int | None) -> torch.Tensor:
    """`x` ([B, S / tp, ...]) whole along the sequence; its backward reduce-scatters (both tagged).

    Under autocast `x` is cast to the autocast dtype first: every consumer is a matmul that would cast it anyway
    (a copy commutes with a cast), so the gather, the gathered activation and the gradient's reduce-scatter move
    half the bytes of the fp32 norm output, as Megatron and torchtitan move them."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        x = x.to(torch.get_autocast_dtype(device))
    backward_tag = node_meta.collective_tag(KIND, node_meta.SEQ_SCATTER, unit, layer)
    with _tagged(node_meta.SEQ_GATHER, unit, layer):
        return SeqCollective.apply(x, group, True, backward_tag)


def scatter_sequence(x: torch.Tensor, group: ShardGroup, unit: str, layer: int | None) -> torch.Tensor:
    """This rank's part of the sum of the ranks' `x` ([B, S, ...]); its backward all-gathers (both tagged)."""
    backward_tag = node_meta.collective_tag(KIND, node_meta.SEQ_GATHER, unit, layer)
    with _tagged(node_meta.SEQ_SCATTER, unit, layer):
        return SeqCollective.apply(x, group, False, backward_tag)


# --------------------------------------------------------------------------- the vocabulary split


@dataclasses.dataclass(frozen=True)
class VocabSplit(VocabParallelLoss):
    """The vocabulary cut into tp row blocks of `rows` (the last ones padded): this rank's first id and how many
    of its rows are real ids, and the losses of its logits (`VocabParallelLoss`) with the tp group's collectives."""

    group: ShardGroup
    vocab_size: int

    @property
    def rows(self) -> int:
        return math.ceil(self.vocab_size / self.group.world_size)

    @property
    def start(self) -> int:
        return self.group.rank * self.rows

    @property
    def valid(self) -> int:
        return max(0, min(self.rows, self.vocab_size - self.start))

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        with _tagged(node_meta.LOSS_REDUCE, "", None):
            return _wait(c10d.all_reduce(t, op, self.group.group_name))

    def gather_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_sequence(hidden, self.group, "output", None)


def _embed_forward(split: VocabSplit, module: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """Vocabulary-parallel lookup: this rank's ids looked up (the others read as zero vectors), then the ranks'
    vectors summed and scattered along the sequence, so each rank leaves with its tokens' embeddings."""
    local = tokens - split.start
    here = (local >= 0) & (local < split.valid)
    vectors = F.embedding(torch.where(here, local, 0), module.weight)
    vectors = torch.where(here.unsqueeze(-1), vectors, 0.0)
    return scatter_sequence(vectors, split.group, "tok_embeddings", None)


def _output_forward(split: VocabSplit, module: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary shard of the logits, [B, S, rows], from the sequence-sharded hidden states."""
    return F.linear(split.gather_sequence(hidden), module.weight)


def _region_forward(group: ShardGroup, unit: str, layer: int, forward: Callable, x: torch.Tensor, *args: Any) -> Any:
    """A sequence region: its input gathered along the sequence, its partial-sum output reduce-scattered."""
    out = forward(gather_sequence(x, group, unit, layer), *args)
    return scatter_sequence(out, group, unit, layer)


# --------------------------------------------------------------------------- gradients of replicated weights


class ReplicatedGrads:
    """The norms' weights, whole on every rank but each rank's gradient from its tokens only.

    `reduce` (the `grad_reduce` hook) sums those gradients over the tp ranks; `sq_norm` (the `norm_reduce`
    hook, called right after it by the clip) sums the squared norm over the tp ranks with the replicated
    gradients counted once: the split gradients' part is all-reduced, the replicated part added once.
    """

    def __init__(self, group: ShardGroup, indices: list[int], owners: list[Owner], names: list[str]):
        self.group, self.indices, self.names = group, indices, names  # `names`: each index's parameter
        self.owners = owners  # each index's (module FQN, layer): its reduction is tagged as that module's op
        self._replicated: list[torch.Tensor | None] = []
        self._gathered: Mapping[str, torch.Tensor] = {}  # under pp, other stages' gradient norms (`gathered_norms`)

    def reduce(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The replicated gradients summed over tp; under pp, None for another stage's (left as they are)."""
        grads = list(grads)
        for i, owner in zip(self.indices, self.owners, strict=True):
            if grads[i] is None:
                continue
            with _tagged(node_meta.GRAD_REDUCE, "", owner[1]), fx_traceback.annotate(owned_by(owner)):
                grads[i] = _wait(c10d.all_reduce(grads[i], "sum", self.group.group_name))
        self._replicated = [grads[i] for i in self.indices]
        return grads

    def use_gathered(self, norms: Mapping[str, torch.Tensor]) -> None:
        """Under pp, before `sq_norm`: every stage's gradient norms by name, gathered over the pp ranks (`sq_norm`
        reads another stage's replicated norms there, since this rank holds no gradient of them)."""
        self._gathered = norms

    def sq_norm(self, sq_norm: torch.Tensor) -> torch.Tensor:
        # Another stage's gradient is its norm gathered over pp (the same value its rank computed here).
        norms = [
            torch.linalg.vector_norm(g, 2.0) if g is not None else self._gathered[name]
            for g, name in zip(self._replicated, self.names, strict=True)
        ]
        once = sum((n**2 for n in norms), sq_norm.new_zeros(()))
        self._replicated, self._gathered = [], {}  # the clip has read them; hold no gradient past the step
        with _tagged(node_meta.NORM_REDUCE, "", None):
            split = _wait(c10d.all_reduce((sq_norm - once).clamp(min=0), "sum", self.group.group_name))
        return split + once


# --------------------------------------------------------------------------- the parallelism


@dataclasses.dataclass
class SplitParam:
    """One parameter split over the tp ranks: its name, logical shape and the dimension cut."""

    name: str
    shape: torch.Size
    dim: int


class TensorParallel(Parallelism):
    """A model split over the tp ranks (see the module docstring); built by `tensor_parallelize`."""

    kind = KIND
    label = "TP"
    mesh_dim = MESH_DIM
    shards_state = True
    within_node = True

    def __init__(self, model: nn.Module, group: ShardGroup, split: list[SplitParam], vocab: VocabSplit, grads):
        self.model, self.group, self.vocab, self.grads = model, group, vocab, grads
        self.split = {p.name: p for p in split}

    @classmethod
    def apply(cls, model: nn.Module, mesh: Mesh, cfg: Any, plan: Any) -> TensorParallel | None:
        """TP over the mesh's `tp` dimension as the family's plan declares; None when its degree is 1.

        Raises:
            UserError: the family has no tensor-parallel plan, or the model or sequence does not divide by tp.
        """
        tp = mesh.size(MESH_DIM)
        if tp == 1:
            return None
        why = cls.allows(model, plan, {MESH_DIM: tp}, cfg.training.seq_len)
        if why is not None:
            fix = (
                "set parallelism.tp = 1 (or add a TensorParallelPlan to its ParallelPlan)"
                if plan.tensor_parallel is None
                else "pick a tp that divides it"
            )
            raise UserError(f"{why}; {fix}")
        return tensor_parallelize(model, ShardGroup.of(mesh.group(MESH_DIM)), plan.tensor_parallel, plan.layers)

    @classmethod
    def allows(cls, block: nn.Module, plan: Any, degrees: Mapping[str, int], seq_len: int) -> str | None:
        """tp needs the family's tensor-parallel plan, and must divide the heads, the KV heads, the split widths
        and the sequence (`indivisible`); the vocabulary is padded instead."""
        tp = degrees.get(MESH_DIM, 1)
        if tp == 1:
            return None
        if plan.tensor_parallel is None:
            return f"model {type(block).__name__} declares no tensor-parallel plan"
        return indivisible(block, plan, tp, seq_len)

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """`loss_fn` with the logits taken as this rank's vocabulary shard (the vocabulary-parallel loss)."""

        @functools.wraps(loss_fn)
        def loss(model: nn.Module, batch: Any) -> torch.Tensor:
            with vocab_parallel(self.vocab):
                return loss_fn(model, batch)

        return loss

    def grad_reduce(self) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
        return self.grads.reduce if self.grads.indices else None

    def norm_reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.grads.sq_norm

    def gathered_norms(self, norms: Mapping[str, torch.Tensor]) -> None:
        self.grads.use_gathered(norms)

    def release(self, names: Collection[str]) -> None:
        """Another stage's embedding or output projection, removed by the pipeline's cut: no longer this rank's."""
        for name in names:
            self.split.pop(name, None)

    def shard_sum(self) -> Callable[[float], float]:
        return self._sum_over_group

    def _sum_over_group(self, value: float) -> float:
        """Summed over the tp ranks: the divergence guard's parameter norm (the small replicated norm weights
        count tp times, the same every step: the guard compares the norm with itself over time)."""
        total = torch.tensor(value, dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group.group)
        return total.item()

    def full_shapes(self) -> dict[str, torch.Size]:
        return {name: p.shape for name, p in self.split.items()}

    def local_slices(self, name: str, local: torch.Tensor) -> tuple[slice, ...] | None:
        """This rank's torch.chunk block of `name` along its split dimension (as `_split_weight` cut it), the
        vocabulary's padding rows left out; None for a parameter left whole (the norms)."""
        p = self.split.get(name)
        if p is None:
            return None
        start, stop = _block(p.shape[p.dim], self.group)
        return tuple(slice(start, stop) if d == p.dim else slice(0, n) for d, n in enumerate(p.shape))

    def full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with every split parameter gathered whole (padding cut off). A collective: every tp rank calls it."""
        out = dict(state)
        with torch.no_grad():
            for name, p in self.split.items():
                if name not in state:  # a tied weight's second name
                    continue
                local = state[name].detach().movedim(p.dim, 0).contiguous()
                whole = torch.empty(
                    (self.group.world_size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device
                )
                dist.all_gather_into_tensor(whole, local, group=self.group.group)
                out[name] = whole[: p.shape[p.dim]].movedim(0, p.dim).contiguous()
        return out


def indivisible(model: nn.Module, plan: Any, tp: int, seq_len: int) -> str | None:
    """The first size of `model` (a block is enough, on meta) or of the sequence that tp does not divide, said in
    words (None: tp divides them all). The one check: the trainer refuses with it, the search skips with it."""
    args = model.args
    sizes = {"model.n_heads": args.n_heads, "model.n_kv_heads": getattr(args, "kv_heads", args.n_heads)}
    sizes["training.seq_len"] = seq_len
    for rel in plan.tensor_parallel.colwise:
        sizes[f"the width of {rel}"] = _first_layer(model, plan.layers).get_submodule(rel).weight.shape[0]
    for what, n in sizes.items():
        if n % tp:
            return f"{what} = {n} does not divide by parallelism.tp = {tp}"
    return None


def _first_layer(model: nn.Module, layers: str) -> nn.Module:
    """The first block that holds its parameters (a pipeline stage's rank holds only its own blocks')."""
    blocks = [model.get_submodule(fqn) for fqn in transformer_layers(model, layers)]
    return next(b for b in blocks if next(b.parameters(), None) is not None)


def _block(length: int, group: ShardGroup) -> tuple[int, int]:
    """[start, stop) of this rank's torch.chunk block of `length` entries: blocks of ceil(length / tp), the last
    ones short or empty (the padding that makes them whole is not in [start, stop))."""
    size = math.ceil(length / group.world_size)
    start = min(group.rank * size, length)
    return start, min(start + size, length)


def _split_weight(module: nn.Module, dim: int, group: ShardGroup) -> nn.Parameter:
    """This rank's torch.chunk block of `module.weight` along `dim`, zero-padded to ceil(size / tp)."""
    w = module.weight
    start, stop = _block(w.shape[dim], group)
    block = w.detach().narrow(dim, start, stop - start)
    shape = list(w.shape)
    shape[dim] = math.ceil(w.shape[dim] / group.world_size)
    part = torch.zeros(shape, dtype=w.dtype, device=w.device)
    if part.device.type != "meta":
        part.narrow(dim, 0, block.shape[dim]).copy_(block)
    return nn.Parameter(part, requires_grad=w.requires_grad)


def _iter_split(model: nn.Module, plan: Any, layers: dict[str, int]) -> Iterator[tuple[str, nn.Module, int]]:
    """(module FQN, module, dim) of every Linear/Embedding the plan splits."""
    for fqn in layers:
        for rel in plan.colwise:
            yield f"{fqn}.{rel}", model.get_submodule(f"{fqn}.{rel}"), COLUMN
        for rel in plan.rowwise:
            yield f"{fqn}.{rel}", model.get_submodule(f"{fqn}.{rel}"), ROW
    for rel in (plan.embedding, plan.output):
        yield rel, model.get_submodule(rel), COLUMN


def tensor_parallelize(
    model: nn.Module, group: ShardGroup, plan: Any, layers_name: str | None = None
) -> TensorParallel:
    """Split `model` over `group` as `plan` (a `TensorParallelPlan`) declares, in place: weights replaced by this
    rank's blocks (same names), head counts made per-rank, the regions' forwards wrapped with their collectives.

    Every rank must call it on an identically initialized model.

    Raises:
        UserError: a parameter the plan neither splits nor runs sequence-parallel (the plan would be wrong).
    """
    layers = transformer_layers(model, layers_name)
    vocab = VocabSplit(group, model.get_submodule(plan.embedding).weight.shape[0])
    done: dict[int, nn.Parameter] = {}  # tied weights: one block for every slot
    split = []
    for fqn, module, dim in _iter_split(model, plan, layers):
        if "weight" not in module._parameters:  # another pipeline stage's block, removed from this rank's model
            continue
        whole = module.weight
        if id(whole) not in done:
            done[id(whole)] = _split_weight(module, dim, group)
        module.weight = done[id(whole)]
        split.append(SplitParam(f"{fqn}.weight", whole.shape, dim))
    for fqn, index in layers.items():
        _wrap_layer(model.get_submodule(fqn), fqn, index, group, plan)
    embedding, output = model.get_submodule(plan.embedding), model.get_submodule(plan.output)
    embedding.forward = functools.partial(_embed_forward, vocab, embedding)
    output.forward = functools.partial(_output_forward, vocab, output)
    replicated = _replicated_names(model, plan, layers)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    indices = [i for i, name in enumerate(names) if name in replicated]
    owners = gradient_owners(model, layers_name)
    grads = ReplicatedGrads(group, indices, [owners[i] for i in indices], [names[i] for i in indices])
    return TensorParallel(model, group, split, vocab, grads)


def _wrap_layer(layer: nn.Module, fqn: str, index: int, group: ShardGroup, plan: Any) -> None:
    for rel, attrs in plan.local_counts:
        module = layer.get_submodule(rel)
        for attr in attrs:
            setattr(module, attr, getattr(module, attr) // group.world_size)
    for rel in plan.sequence_regions:
        region = layer.get_submodule(rel)
        forward = type(region).forward.__get__(region)
        region.forward = functools.partial(_region_forward, group, f"{fqn}.{rel}", index, forward)


def _replicated_names(model: nn.Module, plan: Any, layers: dict[str, int]) -> set[str]:
    """The parameters left whole: those of the sequence-parallel modules (the norms), by name.

    Raises:
        UserError: a parameter that the plan does not place.
    """
    modules = [f"{fqn}.{rel}" for fqn in layers for rel in plan.sequence_parallel]
    modules += [plan.final_norm] if plan.final_norm else []
    replicated = {f"{m}.{name}" for m in modules for name, _ in model.get_submodule(m).named_parameters()}
    split = {f"{fqn}.weight" for fqn, _, _ in _iter_split(model, plan, layers)}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name not in replicated and name not in split:
            raise UserError(
                f"parameter {name} is neither split nor sequence-parallel in the model's TensorParallelPlan; "
                "add its module to the plan, or set parallelism.tp = 1"
            )
    return replicated


__all__ = [
    "KIND",
    "ReplicatedGrads",
    "SeqCollective",
    "TensorParallel",
    "VocabSplit",
    "gather_sequence",
    "scatter_sequence",
    "tensor_parallelize",
]
