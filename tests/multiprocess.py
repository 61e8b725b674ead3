"""Helpers for tests that train on several spawned ranks (gloo on CPU): spawn them, train runs in each.

A worker function given to `spawn_ranks` runs in each rank; inside it, `train_runs` joins the process
group once, trains each run and leaves the group at the end.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from graph_trainer.distributed.launch import destroy, init_distributed
from graph_trainer.distributed.mesh import Mesh, ParallelDims, build_mesh
from graph_trainer.job_config.cli import load_config
from graph_trainer.trainer import Trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable[..., None], world: int, args: tuple, timeout_s: float) -> None:
    """Run `worker(rank, *args)` in `world` fresh processes; fail the test if they take over `timeout_s`.

    The processes fork from a server that imported torch, the trainer and DCP once (`forkserver`, those modules
    preloaded): a spawned rank spent about 5 s of CPU importing them, a forked one none. The server is
    single-threaded, so forking it is safe, unlike forking the pytest worker and its threads. A rank sees the
    environment the server started with, not a test's later changes to `os.environ`: pass what ranks need in `args`."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        [__name__, "graph_trainer.trainer", "graph_trainer.checkpoint.sharded"]
    )
    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="forkserver")
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
    on_built: Callable[[str, Trainer], None] | None = None,
) -> Iterator[tuple[str, Trainer, Any]]:
    """In a spawned rank: join the group once, then train each run (`args` + its overrides, dumping under
    `out/<name>` unless the overrides name a --job.dump_folder), yielding (name, trainer, result).
    `on_built(name, trainer)` sees each trainer before it trains; `before_leaving(cfg)` runs last, still in the
    group."""
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
            trainer = Trainer(cfg, mesh=_mesh_for(cfg, info))
            if on_built is not None:
                on_built(name, trainer)
            result = trainer.train()
            torch.use_deterministic_algorithms(False)
            yield name, trainer, result
        if before_leaving is not None:
            before_leaving(cfg)
    finally:
        if info is not None:
            destroy(info)


def _mesh_for(cfg: Any, joined: Mesh) -> Mesh:
    """The mesh of `cfg`'s layout over the ranks already joined (another layout of the same ranks: a reshard)."""
    dims = ParallelDims.from_config(cfg.parallelism)
    return joined if dims == joined.dims else build_mesh(dims, joined.rank, joined.device)


class LogLines(logging.Handler):
    """This process's trainer log lines, kept to be written with a rank's record (rank 0 logs progress, the
    others warnings only)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger("graph_trainer").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


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


def settled_bytes(tracker: Any, quiet_s: float = 0.5, timeout_s: float = 30.0) -> int:
    """The tracker's live bytes once gloo's worker threads have let go of the step's collective buffers.

    A worker drops a finished collective's work object (and the tensors only it still holds) a moment after
    the step's thread saw it complete, so bytes read right at the step's end can include such a buffer
    (4 bytes once, on the CI machine). Wait for every rank's collectives, then until the count has stayed
    unchanged for `quiet_s`. A tensor the step really leaks never goes, so it still shows.
    """
    dist.barrier()
    deadline = time.monotonic() + timeout_s
    last, since = tracker.current_bytes, time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        if tracker.current_bytes != last:
            last, since = tracker.current_bytes, time.monotonic()
    return last


def state_bytes(trainer: Trainer) -> int:
    """Parameters + gradients + optimizer state held by this process, in bytes."""
    tensors = [*trainer.model.parameters(), *(p.grad for p in trainer.model.parameters() if p.grad is not None)]
    tensors += [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def save_full_params(trainer: Trainer, out: str, name: str, rank: int) -> None:
    """The run's final parameters, gathered whole (a collective: every rank calls it), saved by rank 0."""
    full = trainer.parallel.full_state()
    if rank == 0:
        torch.save(full, os.path.join(out, f"{name}.params.pt"))


def train_one_process(args: list[str], dump_folder: str) -> tuple[Trainer, Any]:
    """`args` trained by this process alone (deterministic kernels switched off again after)."""
    cfg, _ = load_config([*args, "--job.dump_folder", dump_folder])
    try:
        trainer = Trainer(cfg)
        return trainer, trainer.train()
    finally:
        torch.use_deterministic_algorithms(False)


def export_checkpoint(step: Any, dest: Any, cwd: Any) -> Any:
    """`python -m graph_trainer.export STEP DEST` in a clean environment (no torchrun): the CompletedProcess."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return subprocess.run(
        [sys.executable, "-m", "graph_trainer.export", str(step), str(dest)],
        cwd=cwd,
        env={"PYTHONPATH": str(repo), "PATH": ""},
        capture_output=True,
        text=True,
    )


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two sets of whole parameters of the same names and shapes."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_bitwise_equal_runs(reference: dict, run: dict, steps: int, name: str) -> None:
    """Two records of one rank: the same losses and final shards (sha256), and one trace for a traced run."""
    assert len(run["losses"]) == steps
    assert run["losses"] == reference["losses"]
    assert run["params"] == reference["params"]  # this rank's final shards
    if name.startswith("trace"):
        assert run["trace_count"] == 1


def step_graph_nodes(trainer: Trainer) -> list[torch.fx.Node]:
    """The nodes of the trainer's final step graph ([] for an eager step, or a traced one that never ran)."""
    traced = getattr(trainer.step_fn, "traced", None)
    return list(traced.gm.graph.nodes) if traced is not None else []


def train_fully_shard(cfg: Any, rank: int, world: int, mp_policy: Any = None) -> tuple[list[float], dict]:
    """In a spawned rank, inside the group: `cfg`'s job trained with torch's FSDP2 (`fully_shard` on each layer
    and the root, `mp_policy` if given) and torch's clip. Returns the mean losses and the final full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from graph_trainer.loss import lm_loss

    torch.use_deterministic_algorithms(True)
    model, data = _reference_model_and_data(cfg, rank, world)
    mesh = init_device_mesh("cpu", (world,))
    policy = mp_policy or MixedPrecisionPolicy()
    for layer in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)

    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)

    losses = _reference_loop(cfg, model, data, lm_loss, clip, world)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    torch.use_deterministic_algorithms(False)
    return losses, full


def train_dtensor_tp(cfg: Any, world: int) -> tuple[list[float], dict]:
    """In a spawned rank, inside the group: `cfg`'s job trained with torch's own tensor parallelism: DTensor
    `parallelize_module` with torchtitan's Llama plan (Colwise/Rowwise/SequenceParallel, the embedding
    row-wise, the output column-wise) and `loss_parallel`, on one `tp` mesh of `world` ranks that read the
    same batch. Returns the losses and the final full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    from graph_trainer.loss import lm_loss

    torch.use_deterministic_algorithms(True)
    model, data = _reference_model_and_data(cfg, 0, 1)  # tp peers read the same batch
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh, root_plan)
    layer_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            # (x, cos, sin, mask): only x is sharded (over the sequence); the mask is None without document masking
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for layer in model.layers:
        layer.attention.n_heads //= world
        layer.attention.n_kv_heads //= world
        parallelize_module(layer, mesh, layer_plan)
    params = list(model.parameters())

    def clip() -> None:  # torchtitan's clip over DTensor gradients: the total norm made whole, then applied
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        total = total.full_tensor() if isinstance(total, DTensor) else total
        torch.nn.utils.clip_grads_with_norm_(params, cfg.training.max_norm, total)

    with loss_parallel():  # the backward must run inside it too (and it does not nest)
        losses = _reference_loop(cfg, model, data, lm_loss, clip, 1)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    torch.use_deterministic_algorithms(False)
    return losses, full


def _reference_model_and_data(cfg: Any, rank: int, world: int) -> tuple[torch.nn.Module, Iterator]:
    """`cfg`'s model, whole and initialized as every rank initializes it, and data-parallel rank `rank`'s batches."""
    from graph_trainer.builder import build_model
    from graph_trainer.data.loader import build_dataloader
    from graph_trainer.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg, torch.device("cpu"), vocab_needed=tokenizer.vocab_size)
    t = cfg.training
    loader = build_dataloader(
        cfg.data.source, cfg.data.path, tokenizer, batch_size=t.local_batch_size, seq_len=t.seq_len,
        seed=t.seed, rank=rank, world_size=world,
    )  # fmt: skip
    return model, iter(loader)


def _reference_loop(
    cfg: Any, model: torch.nn.Module, data: Iterator, loss_fn: Callable, clip: Callable[[], None], world: int
) -> list[float]:
    """`cfg.training.steps` plain steps of torch's AdamW and our LR schedule; the losses averaged over `world`."""
    import torch.distributed as dist

    from graph_trainer.builder import build_job_scheduler
    from graph_trainer.optimizer.adamw import build_optimizer

    o = cfg.optimizer
    optimizer = build_optimizer(
        model, name=o.name, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
    )
    scheduler = build_job_scheduler(cfg, optimizer)
    losses = []
    for _ in range(cfg.training.steps):
        loss = loss_fn(model, next(data))
        loss.backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        total = loss.detach().clone()
        total = total.full_tensor() if hasattr(total, "full_tensor") else total  # a DTensor loss (loss_parallel)
        if world > 1:
            dist.all_reduce(total)
        losses.append((total / world).item())
    return losses
