"""Data parallelism over processes: launch checks, the process group, and gradient averaging.

One process per rank, launched by torchrun (which sets RANK, WORLD_SIZE and
LOCAL_RANK); every rank trains on a disjoint slice of the data
(`graph_trainer.data.loader`). Two ways, named as torchtitan names them:
- `parallelism.dp_shard = N` is FSDP: parameters, gradients and optimizer
  state are sharded (`graph_trainer.distributed.fsdp`);
- `parallelism.dp_replicate = N` keeps a full copy on every rank; after the
  backward each gradient is averaged over the ranks (`GradAverager`), so all
  ranks take the same optimizer step and stay identical.
Both at once (HSDP) is refused.

The averaging uses traceable functional collectives
(`torch.distributed._functional_collectives`): called inside the traced step
they become `_c10d_functional.all_reduce` + `wait_tensor` nodes of the one step
graph; called eagerly they run the same ops, so eager and traced steps agree
bitwise. The tracer knows nothing of this: it receives a `GradReduce` hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from graph_trainer.distributed.fsdp import ShardGroup
from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.runtime.device import resolve_device

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process stands: its rank, the number of ranks, its device and process group."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None  # None for a single process
    sharded: bool = False  # FSDP (dp_shard) rather than replication (dp_replicate)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def grad_reduce(self) -> GradAverager | None:
        """The hook that averages replicated gradients over the ranks; None for one process or FSDP
        (whose gather's backward reduce-scatters them)."""
        return GradAverager(self.group, self.world_size) if self.is_distributed and not self.sharded else None

    def shard_group(self) -> ShardGroup | None:
        """What FSDP shards over (`parallelism.dp_shard` > 1), else None."""
        return ShardGroup.of(self.group) if self.sharded and self.group is not None else None

    def global_average(self, t: torch.Tensor) -> torch.Tensor:
        """`t` averaged over the ranks (a new tensor; `t` itself for a single process). For logging."""
        if not self.is_distributed:
            return t
        total = t.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total / self.world_size

    def sum_over_ranks(self, value: float) -> float:
        """`value` summed over the ranks, in float64 (`value` itself for a single process)."""
        if not self.is_distributed:
            return value
        total = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total.item()

    def barrier(self) -> None:
        """Wait for every rank (no-op for a single process)."""
        if self.is_distributed:
            dist.barrier(group=self.group)


@dataclasses.dataclass(frozen=True)
class GradAverager:
    """`GradReduce` hook: each gradient all-reduced (sum) over `group`, then divided by the world size.

    One all-reduce per gradient (no bucketing). Sum-then-divide rather than the
    "avg" reduce op so that every backend (gloo, nccl) runs the same arithmetic.
    """

    group: dist.ProcessGroup
    world_size: int

    def __call__(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed._functional_collectives as funcol  # absent from builds without distributed

        # Under make_fx the functional all_reduce is traced with its wait_tensor; eagerly
        # the division waits on the AsyncCollectiveTensor it returns.
        return [funcol.all_reduce(g, "sum", self.group) / self.world_size for g in grads]


def _launch_env(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's variables, or None when not launched by it."""
    if "WORLD_SIZE" not in env:
        return None
    try:
        rank, world_size = int(env.get("RANK", "0")), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise UserError(
            f"RANK/WORLD_SIZE/LOCAL_RANK must be integers, got "
            f"{ {k: env.get(k) for k in LAUNCH_ENV} }; launch with torchrun"
        ) from None
    if world_size < 1 or not 0 <= rank < world_size:
        raise UserError(f"RANK {rank} is outside WORLD_SIZE {world_size}; launch with torchrun")
    return rank, world_size, local_rank


def data_parallel_degree(cfg: JobConfig) -> tuple[str, int]:
    """('dp_shard' or 'dp_replicate', degree): the one data-parallel option in use ('dp_shard', 1 when none).

    Raises:
        UserError: both are above 1 (HSDP, not supported).
    """
    shard, replicate = cfg.parallelism.dp_shard, cfg.parallelism.dp_replicate
    if shard > 1 and replicate > 1:
        raise UserError(
            f"parallelism.dp_shard = {shard} with parallelism.dp_replicate = {replicate} (HSDP) is "
            "not supported; use one of them: --parallelism.dp_shard N (FSDP) or "
            "--parallelism.dp_replicate N (replicated)"
        )
    return ("dp_replicate", replicate) if replicate > 1 else ("dp_shard", shard)


def check_launch(cfg: JobConfig, env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) of this process; raises UserError when the launch does not fit the config."""
    env = os.environ if env is None else env
    option, dp = data_parallel_degree(cfg)
    launched = _launch_env(env)
    if launched is None:
        if dp > 1:
            raise UserError(
                f"parallelism.{option} = {dp} needs one process per rank; launch with "
                f"`torchrun --nproc_per_node {dp} -m graph_trainer ...` or set "
                f"parallelism.{option} = 1"
            )
        return 0, 1, 0
    rank, world_size, local_rank = launched
    if world_size != dp:
        raise UserError(
            f"WORLD_SIZE = {world_size} (processes launched) but parallelism.{option} = {dp}; "
            f"pass --parallelism.{option} {world_size} or launch with "
            f"`torchrun --nproc_per_node {dp}`"
        )
    return rank, world_size, local_rank


def single_process(cfg: JobConfig) -> DistInfo:
    """DistInfo of a run that is not distributed; raises UserError if the config or launch asks for ranks."""
    _, world_size, _ = check_launch(cfg)
    if world_size > 1:
        raise UserError(
            f"this process was launched as one of {world_size} ranks but the trainer was built "
            "without a process group; start it through `python -m graph_trainer` "
            "(graph_trainer.distributed.launch.init_distributed)"
        )
    return DistInfo(0, 1, resolve_device(cfg.training.device))


def init_distributed(cfg: JobConfig) -> DistInfo:
    """Check the launch against `parallelism.dp_shard` / `dp_replicate`, and for several ranks join the process group.

    gloo on CPU, nccl on CUDA (device cuda:LOCAL_RANK). Pair with `destroy`.
    """
    rank, world_size, local_rank = check_launch(cfg)
    device = resolve_device(cfg.training.device)
    if world_size == 1:
        return DistInfo(0, 1, device)
    if not dist.is_available():
        raise UserError(
            "data parallelism needs torch.distributed, which this torch build lacks; install a "
            "torch build with distributed support or set parallelism.dp_shard/dp_replicate = 1"
        )
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices; "
                "launch at most one process per GPU (torchrun --nproc_per_node)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        if not dist.is_gloo_available():
            raise UserError(
                "data parallelism on CPU needs the gloo backend, which this torch build lacks; "
                "install a torch build with gloo or set parallelism.dp_shard/dp_replicate = 1"
            )
        backend = "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return DistInfo(rank, world_size, device, dist.group.WORLD, sharded=data_parallel_degree(cfg)[0] == "dp_shard")


@contextlib.contextmanager
def planning_shard_group(cfg: JobConfig) -> Iterator[ShardGroup | None]:
    """Rank 0 of a `parallelism.dp_shard` job for planning (--dry-run): a fake process group of that many
    ranks inside this one process, which traces collectives but never communicates. None without dp_shard."""
    option, n = data_parallel_degree(cfg)
    if option != "dp_shard" or n == 1:
        yield None
        return
    if dist.is_initialized():
        raise UserError("--dry-run plans one rank by itself; run it without torchrun")
    try:  # private, but it is torch's own fake backend (registers "fake" on import)
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # pragma: no cover - torch without its testing package
        raise UserError(
            f"--dry-run with parallelism.dp_shard > 1 needs torch's fake process group ({e}); "
            "plan with parallelism.dp_shard = 1"
        ) from None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        yield ShardGroup.of(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def destroy(info: DistInfo, *, wait_for_all: bool = False, timeout_s: float = 120.0) -> None:
    """Leave the process group `init_distributed` joined (no-op for a single process).

    With `wait_for_all` (a run that ended normally) every rank first meets the
    others, so none tears its connections down while a peer is still in a
    collective; on gloo the barrier is a monitored one, which fails after
    `timeout_s` instead of hanging when a peer died. Afterwards the garbage that
    still holds the group or collective buffers is collected while the
    interpreter is fully alive: gloo's worker threads release their last
    references late, and a release during interpreter shutdown aborts the
    process (SIGABRT, "terminate called without an active exception").
    """
    if not (info.is_distributed and dist.is_initialized()):
        return
    try:
        if wait_for_all:
            if dist.get_backend(info.group) == "gloo":
                dist.monitored_barrier(info.group, timeout=datetime.timedelta(seconds=timeout_s))
            else:
                dist.barrier(info.group)
    finally:
        dist.destroy_process_group()
        gc.collect()


__all__ = [
    "DistInfo",
    "GradAverager",
    "check_launch",
    "data_parallel_degree",
    "single_process",
    "init_distributed",
    "planning_shard_group",
    "destroy",
]
