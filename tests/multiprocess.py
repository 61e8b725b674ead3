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

from graph_trainer.cli import load_config
from graph_trainer.distributed import destroy, init_distributed
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


def train_runs(rank: int, world: int, port: int, runs: dict[str, list[str]], args: list[str], out: str,
               before_leaving: Callable[[Any], None] | None = None) -> Iterator[tuple[str, Trainer, Any]]:
    """In a spawned rank: join the group once, then train each run (`args` + its overrides, dumping under
    `out/<name>` unless the overrides name a --job.dump_folder), yielding (name, trainer, result).
    `before_leaving(cfg)` runs last, still in the group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # several ranks on 2 cores
    info, cfg = None, None
    try:
        for name, overrides in runs.items():
            dump = [] if "--job.dump_folder" in overrides else ["--job.dump_folder", f"{out}/{name}"]
            cfg, _ = load_config([*args, *overrides, *dump])
            info = info or init_distributed(cfg)
            trainer = Trainer(cfg, dist=info)
            result = trainer.train()
            torch.use_deterministic_algorithms(False)
            yield name, trainer, result
        if before_leaving is not None:
            before_leaving(cfg)
    finally:
        if info is not None:
            destroy(info)


def step_graph_nodes(trainer: Trainer) -> list[torch.fx.Node]:
    """The nodes of the trainer's final step graph ([] for an eager step)."""
    return list(trainer.step_fn.traced.gm.graph.nodes) if hasattr(trainer.step_fn, "traced") else []
