"""Helpers for tests that train on several spawned ranks (gloo on CPU): spawn them, train runs in each.

A worker function given to `spawn_ranks` runs in each rank; inside it, `train_runs` joins the process
group once, trains each run and leaves the group at the end.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from graph_trainer.distributed.launch import destroy, init_distributed
from graph_trainer.job_config.cli import load_config
from graph_trainer.trainer import Trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable[..., None], world: int, args: tuple, timeout_s: float) -> None:
    """Run `worker(rank, *args)` in `world` spawned processes; fail the test if they take over `timeout_s`."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(worker, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world}-process training did not finish in {timeout_s} s")


def train_runs(
    rank: int,
    world: int,
    port: int,
    runs: dict[str, list[str]],
    args: list[str],
    out: str,
    before_leaving: Callable[[Any], None] | None = None,
) -> Iterator[tuple[str, Trainer, Any]]:
    """In a spawned rank: join the group once, then train each run (`args` + its overrides, dumping under
    `out/<name>` unless the overrides name a --job.dump_folder), yielding (name, trainer, result).
    `before_leaving(cfg)` runs last, still in the group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # several ranks on 2 cores
    info, cfg = None, None
    try:
        for name, overrides in runs.items():
            dump = [] if "--job.dump_folder" in overrides else ["--job.dump_folder", f"{out}/{name}"]
            cfg, _ = load_config([*args, *overrides, *dump])
            info = info or init_distributed(cfg)
            trainer = Trainer(cfg, mesh=info)
            result = trainer.train()
            torch.use_deterministic_algorithms(False)
            yield name, trainer, result
        if before_leaving is not None:
            before_leaving(cfg)
    finally:
        if info is not None:
            destroy(info)


def peaks(records: list[dict]) -> list[tuple[int | None, int | None, int]]:
    """(estimated, measured, late-freed bytes) of each step record, for `assert_peaks_match`."""
    return [(r.get("estimated_peak_bytes"), r.get("peak_active_bytes"), r.get("late_free_bytes", 0)) for r in records]


def assert_peaks_match(step_peaks: list, context: Any = None) -> None:
    """Each step's measured CPU peak equals its estimate to the byte, or exceeds it by no more than what
    gloo's worker thread freed late that step (it can drop a collective's buffer after the step's thread
    moved on; the tracker counts that as `late_free_bytes`)."""
    for estimated, measured, late in step_peaks:
        assert estimated is not None and measured is not None, step_peaks
        assert measured == estimated or 0 < measured - estimated <= late, (context, step_peaks)


def step_graph_nodes(trainer: Trainer) -> list[torch.fx.Node]:
    """The nodes of the trainer's final step graph ([] for an eager step)."""
    return list(trainer.step_fn.traced.gm.graph.nodes) if hasattr(trainer.step_fn, "traced") else []


def train_fully_shard(cfg: Any, rank: int, world: int, mp_policy: Any = None) -> tuple[list[float], dict]:
    """In a spawned rank, inside the group: `cfg`'s job trained with torch's FSDP2 (`fully_shard` on each layer
    and the root, `mp_policy` if given) and torch's clip. Returns the mean losses and the final full parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from graph_trainer.builder import build_job_scheduler, build_model
    from graph_trainer.data.loader import build_dataloader
    from graph_trainer.data.tokenizer import build_tokenizer
    from graph_trainer.loss import lm_loss
    from graph_trainer.optimizer.adamw import build_optimizer

    torch.use_deterministic_algorithms(True)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg, torch.device("cpu"), vocab_needed=tokenizer.vocab_size)
    mesh = init_device_mesh("cpu", (world,))
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    o = cfg.optimizer
    optimizer = build_optimizer(
        model, name=o.name, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
    )
    scheduler = build_job_scheduler(cfg, optimizer)
    data = iter(
        build_dataloader(
            cfg.data.source,
            cfg.data.path,
            tokenizer,
            batch_size=cfg.training.local_batch_size,
            seq_len=cfg.training.seq_len,
            seed=cfg.training.seed,
            rank=rank,
            world_size=world,
        )
    )
    losses = []
    for _ in range(cfg.training.steps):
        loss = lm_loss(model, next(data))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    torch.use_deterministic_algorithms(False)
    return losses, full
