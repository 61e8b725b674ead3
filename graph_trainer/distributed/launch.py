"""Launching a job over processes: torchrun's environment checked against the config, the process group
joined and left.

One process per rank, launched by torchrun (which sets RANK, WORLD_SIZE and LOCAL_RANK). The number of
processes must equal the product of the parallelism degrees (`ParallelDims`); the ranks then lay
themselves out once as a named `DeviceMesh` (`graph_trainer.distributed.mesh`), from which every
parallelism takes its process group. gloo on CPU, nccl on CUDA (device cuda:LOCAL_RANK).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from graph_trainer.distributed.mesh import Mesh, ParallelDims, build_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.runtime.device import resolve_device

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def trainer_command(
    nproc_per_node: int = 1, *, python: str | None = None, torchrun_args: Sequence[str] = ()
) -> list[str]:
    """The argv that starts the trainer CLI: `python -m graph_trainer`, or under torchrun on one node with
    `nproc_per_node` processes (`torchrun_args`, e.g. `--log-dir`, go before the module). Append the options."""
    python = python or sys.executable
    if nproc_per_node == 1:
        return [python, "-m", "graph_trainer"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node"]
    return [python, *torchrun, str(nproc_per_node), *torchrun_args, "-m", "graph_trainer"]


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


def _degrees_phrase(dims: ParallelDims) -> tuple[str, str]:
    """('parallelism.dp_shard = 2', 'parallelism.dp_shard') for one dimension, or the product for several."""
    used = {name: n for name, n in dims.degrees().items() if n > 1} or {"dp_shard": 1}
    if len(used) == 1:
        ((name, n),) = used.items()
        return f"parallelism.{name} = {n}", f"parallelism.{name}"
    names = " x ".join(used)
    values = " x ".join(str(n) for n in used.values())
    return f"parallelism.{names} = {values} = {dims.world_size}", "the parallelism degrees"


def check_launch(cfg: JobConfig, env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) of this process; raises UserError when the launch does not fit the config."""
    env = os.environ if env is None else env
    dims = ParallelDims.from_config(cfg.parallelism)
    asked, options = _degrees_phrase(dims)
    launched = _launch_env(env)
    if launched is None:
        if dims.world_size > 1:
            raise UserError(
                f"{asked} needs one process per rank; launch with "
                f"`torchrun --nproc_per_node {dims.world_size} -m graph_trainer ...` or set {options} = 1"
            )
        return 0, 1, 0
    rank, world_size, local_rank = launched
    if world_size != dims.world_size:
        single = options.startswith("parallelism.")
        fix = f"pass --{options} {world_size}" if single else f"make the product of {options} {world_size}"
        raise UserError(
            f"WORLD_SIZE = {world_size} (processes launched) but {asked}; {fix} or launch with "
            f"`torchrun --nproc_per_node {dims.world_size}`"
        )
    return rank, world_size, local_rank


def single_process(cfg: JobConfig) -> Mesh:
    """The mesh of a run that is not distributed; raises UserError if the config or launch asks for ranks."""
    _, world_size, _ = check_launch(cfg)
    if world_size > 1:
        raise UserError(
            f"this process was launched as one of {world_size} ranks but the trainer was built "
            "without a process group; start it through `python -m graph_trainer` "
            "(graph_trainer.distributed.launch.init_distributed)"
        )
    return Mesh(ParallelDims.from_config(cfg.parallelism), 0, resolve_device(cfg.training.device))


def init_distributed(cfg: JobConfig) -> Mesh:
    """Check the launch against `parallelism.*`, and for several ranks join the process group and lay out the mesh.

    gloo on CPU, nccl on CUDA (device cuda:LOCAL_RANK). Pair with `destroy`.
    """
    rank, world_size, local_rank = check_launch(cfg)
    dims = ParallelDims.from_config(cfg.parallelism)
    device = resolve_device(cfg.training.device)
    if world_size == 1:
        return Mesh(dims, 0, device)
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
    return build_mesh(dims, rank, device)


def destroy(mesh: Mesh, *, wait_for_all: bool = False, timeout_s: float = 120.0) -> None:
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
    if not (mesh.is_distributed and dist.is_initialized()):
        return
    try:
        if wait_for_all:
            group = mesh.world_group
            if dist.get_backend(group) == "gloo":
                dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout_s))
            else:
                dist.barrier(group)
    finally:
        dist.destroy_process_group()
        gc.collect()


__all__ = ["check_launch", "destroy", "init_distributed", "single_process", "trainer_command"]
