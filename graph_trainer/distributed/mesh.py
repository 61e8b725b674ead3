"""The ranks of a job laid out once as a named `DeviceMesh`, and where this process stands in it.

`ParallelDims` holds the degree of each parallelism (`parallelism.*`); their product is the number of
processes. `Mesh` is this process's view: its rank, device, the torch `DeviceMesh` with one named dimension
per parallelism of degree > 1, and the coordinates the data loader reads. Every parallelism takes its
process group from here (`Mesh.group(name)`), so the layout is decided in one place.

One process is the degenerate case: no process group, no `DeviceMesh`, every coordinate 0 of 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pickle
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import torch
import torch.distributed as dist

from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import ParallelismConfig

T = TypeVar("T")

# Mesh dimensions, outermost first (torchtitan's order): pipeline stages (which may span nodes: they exchange one
# activation per micro-batch), replicas, then shards within a replica, then tensor-parallel peers innermost
# (adjacent ranks: on a GPU node they talk over the fastest links).
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
DATA_PARALLEL = ("dp_replicate", "dp_shard")  # the dimensions over which ranks read different data
# Expert parallelism is carved out of dp_shard, not multiplied into the world: dp_shard = EXPERT_SHARD x ep, and
# the named "dp_shard" dimension is those two flattened (ep innermost: an ep group is dp_shard's neighbours).
EP = "ep"
EXPERT_SHARD = "dp_shard_mod_ep"  # the ranks that hold the same routed experts (FSDP over dp_shard / ep)


def ring(dim: str, degrees: Mapping[str, int]) -> tuple[int, int]:
    """(size, stride) of the rings that mesh dimension `dim` makes in a layout of `degrees`: how many ranks each
    holds, and how far apart they are (the product of the dimensions inside it, `DIMS` outermost first; `ep` is
    the inner part of dp_shard). What the cost model needs to price a collective over `dim`."""
    inner = DIMS[DIMS.index("dp_shard" if dim == EP else dim) + 1 :]
    return degrees.get(dim, 1), math.prod(degrees.get(d, 1) for d in inner)


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism; `world_size` is their product."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1  # carved out of dp_shard: not a factor of world_size

    @classmethod
    def from_config(cls, p: ParallelismConfig) -> ParallelDims:
        """The degrees `parallelism.*` asks for.

        Raises:
            UserError: a combination the trainer cannot run (ep that does not divide dp_shard, ep with tp).
                dp_replicate with dp_shard is HSDP: replicas of a sharded model (distributed/replicate.py).
        """
        if p.dp_shard % p.ep:
            raise UserError(
                f"parallelism.ep = {p.ep} does not divide parallelism.dp_shard = {p.dp_shard}: expert parallelism is "
                "carved out of dp_shard; pick an ep that divides it"
            )
        if p.ep > 1 and p.tp > 1:
            # Each was tested on its own; the dispatch under sequence-sharded tokens is not wired yet.
            raise UserError(
                "parallelism.ep > 1 with parallelism.tp > 1 is not supported yet: use one of them "
                "(set --parallelism.ep 1 or --parallelism.tp 1)"
            )
        return cls(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, ep=p.ep)

    def degrees(self) -> dict[str, int]:
        """Every dimension's degree, outermost first."""
        return {name: getattr(self, name) for name in DIMS}

    @property
    def world_size(self) -> int:
        size = 1
        for degree in self.degrees().values():
            size *= degree
        return size

    def describe(self) -> str:
        """e.g. 'dp_shard 8' or 'one process'."""
        used = [f"{name} {n}" for name, n in self.degrees().items() if n > 1]
        return (" x ".join(used) or "one process") + (f" (ep {self.ep})" if self.ep > 1 else "")

    def used(self) -> list[str]:
        """The dimensions of degree > 1, outermost first."""
        return [name for name, n in self.degrees().items() if n > 1]

    def launch_hint(self) -> str:
        """The options that ask for these degrees, e.g. '--parallelism.dp_shard 8'."""
        used = [f"--parallelism.{name} {n}" for name, n in self.degrees().items() if n > 1]
        return " ".join(used + ([f"--parallelism.ep {self.ep}"] if self.ep > 1 else []))


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This process's place in the job: rank, device, and the named `DeviceMesh` (None for one process)."""

    dims: ParallelDims
    rank: int
    device: torch.device
    device_mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_distributed(self) -> bool:
        return self.device_mesh is not None

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank of the job (None for one process)."""
        return dist.group.WORLD if self.is_distributed else None

    def size(self, name: str) -> int:
        """The degree of dimension `name` (1 when the job does not use it; `ep` and `dp_shard_mod_ep` too)."""
        if name == EP:
            return self.dims.ep
        if name == EXPERT_SHARD:
            return self.dims.dp_shard // self.dims.ep
        return self.dims.degrees()[name]

    def coordinate(self, name: str) -> int:
        """This rank's index along dimension `name` (0 when the job does not use it)."""
        if self.size(name) == 1:
            return 0
        return self.device_mesh.get_local_rank(name)

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of this rank's peers along dimension `name` (None when its degree is 1)."""
        if self.size(name) == 1:
            return None
        return self.device_mesh.get_group(name)

    @property
    def data_rank(self) -> int:
        """Which slice of the data this rank reads: its index among the data-parallel ranks."""
        rank = 0
        for name in DATA_PARALLEL:
            rank = rank * self.size(name) + self.coordinate(name)
        return rank

    @property
    def data_size(self) -> int:
        """How many slices the data is cut into: the data-parallel degree."""
        size = 1
        for name in DATA_PARALLEL:
            size *= self.size(name)
        return size

    def global_average(self, t: torch.Tensor) -> torch.Tensor:
        """`t` averaged over every rank (a new tensor; `t` itself for one process). For logging."""
        if not self.is_distributed:
            return t
        return self._world_sum(t) / self.world_size

    def loss_average(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss averaged over the data-parallel ranks, the same on every rank: under pipeline
        parallelism one copy per pipeline is taken (the last stage's rank's; the others pass zeros, which add
        nothing). For logging."""
        if not self.is_distributed:
            return loss
        last_stage = self.coordinate("pp") == self.size("pp") - 1
        return self._world_sum(loss if last_stage else torch.zeros_like(loss)) / (self.world_size // self.size("pp"))

    def _world_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over every rank, into a new tensor (one all-reduce)."""
        total = t.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.world_group)
        return total

    def max_over_ranks(self, value: int) -> int:
        """The largest of every rank's `value`, the same answer on every rank (`value` itself for one process).

        One all-reduce of one integer: how ranks agree on a decision one of them made (rank 0's folder
        lock, a write that failed on some rank) so that all of them stop, or go on, together.
        """
        if not self.is_distributed:
            return value
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world_group)
        return int(flag.item())

    def from_first_rank(self, make: Callable[[], T]) -> T:
        """`make()` run by rank 0 alone and handed to every rank (one `broadcast_object_list`), so that every rank
        takes the same answer of a computation whose answer can depend on the machine (a solver stopped at its time
        limit) and the others do not spend the time. An exception `make` raises is raised on every rank, so none
        waits for an answer that will not come. One process: `make()`."""
        if not self.is_distributed:
            return make()
        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = (True, make())
            except Exception as e:  # noqa: BLE001 (raised again below, on every rank)
                box[0] = (False, _sendable(e))
        dist.broadcast_object_list(box, src=0, group=self.world_group)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""
        if self.is_distributed:
            dist.barrier(group=self.world_group)


def _sendable(error: Exception) -> Exception:
    """`error`, or a RuntimeError with its words where it cannot be pickled (one holding a lambda, say): the broadcast
    would fail on rank 0 alone and leave the others waiting for it."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 (any failure to pickle)
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def build_mesh(dims: ParallelDims, rank: int, device: torch.device) -> Mesh:
    """The job's mesh over the process group already joined (or one process's, when `dims` asks for one)."""
    if dims.world_size == 1:
        return Mesh(dims, 0, device)
    from torch.distributed.device_mesh import init_device_mesh

    used = {name: n for name, n in dims.degrees().items() if n > 1}
    if dims.ep > 1:  # dp_shard laid out as (dp_shard / ep, ep), then flattened back under its own name
        used = {k: v for name, n in used.items() for k, v in _split_dp_shard(name, n, dims.ep)}
    device_mesh = init_device_mesh(device.type, tuple(used.values()), mesh_dim_names=tuple(used))
    if dims.ep > 1:
        device_mesh[EXPERT_SHARD, EP]._flatten("dp_shard")
    return Mesh(dims, rank, device, device_mesh)


def _split_dp_shard(name: str, degree: int, ep: int) -> list[tuple[str, int]]:
    """`dp_shard` as its two factors (experts' FSDP ranks outer, ep inner); any other dimension as it is."""
    return [(EXPERT_SHARD, degree // ep), (EP, ep)] if name == "dp_shard" else [(name, degree)]


@contextlib.contextmanager
def planning_mesh(dims: ParallelDims, device: torch.device, rank: int = 0) -> Iterator[Mesh]:
    """Rank `rank` (0 unless said) of a job of `dims.world_size` ranks, for planning (--dry-run): torch's fake
    process group inside this one process, which runs collectives but never communicates. One process: the plain
    mesh."""
    if dims.world_size == 1:
        yield Mesh(dims, 0, device)
        return
    if dist.is_initialized():
        raise UserError("--dry-run plans one rank by itself; run it without torchrun")
    try:  # private, but it is torch's own fake backend (registers "fake" on import)
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # pragma: no cover - torch without its testing package
        raise UserError(
            f"--dry-run with {dims.describe()} needs torch's fake process group ({e}); plan one process instead"
        ) from None
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        # The fake backend has no device of its own: the mesh is laid out on the CPU, whatever device is planned.
        mesh = build_mesh(dims, rank, torch.device("cpu"))
        yield dataclasses.replace(mesh, device=device)
    finally:
        dist.destroy_process_group()


__all__ = ["DATA_PARALLEL", "DIMS", "EP", "EXPERT_SHARD", "Mesh", "ParallelDims", "build_mesh", "planning_mesh", "ring"]
