"""Gradient accumulation with FSDP (`parallelism.dp_shard 2`, gloo), for both `parallelism.fsdp_grad_sync`s.

Claims tested, on a global batch whose micro-batches (and ranks) hold very uneven numbers of valid tokens:
- the traced accumulated step's gradients (gathered whole) and loss are bitwise equal to eager FSDP accumulation,
  with the gradients reduce-scattered every micro-batch (micro_batch, the default) or once per step (step);
- micro_batch: the micro graph reduce-scatters each unit's gradient once (so once per micro-batch), the update
  graph none; step: the other way round;
- both equal one process's step on the whole global batch within the tolerance of tests/test_accumulation.py:
  the token count is the global one (over micro-batches and ranks), not a mean of per-rank means.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graph_trainer.builder import build_job
from graph_trainer.distributed.fsdp import _gather
from graph_trainer.distributed.launch import destroy, init_distributed
from graph_trainer.job_config.cli import load_config
from tests.multiprocess import free_port, spawn_ranks
from tests.test_accumulation import ATOL, BASE, RTOL, B, K, _batch, _grads, _job

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # two ranks trace and run two steps each: ~40 s on 2 cores
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]
WORLD = 2
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"
SYNCS = ("micro_batch", "step")


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    args = [*BASE, "--parallelism.dp_shard", str(WORLD), "--training.max_norm", "0"]
    args += ["--training.local_batch_size", str(B), "--training.global_batch_size", str(K * B)]
    mesh = None
    try:
        batch = {k: v.chunk(WORLD)[rank] for k, v in _batch().items()}  # this rank's K / WORLD micro-batches
        for sync, mode in [(sync, mode) for sync in SYNCS for mode in ("eager", "trace")]:
            cfg, _ = load_config([*args, "--compile.mode", mode, "--parallelism.fsdp_grad_sync", sync])
            mesh = mesh or init_distributed(cfg)
            job = build_job(cfg, mesh)
            step = job.build_step(optimizer_update=False)
            loss, _ = step(batch)
            fsdp = job.parallel.parts[0]
            grads = {}
            for unit in fsdp.units:
                shards = [p.grad for p in unit.current()]
                grads.update(zip(unit.param_names, _gather(unit, fsdp.group, shards, None, None), strict=True))
            record = {"loss": mesh.global_average(loss), "grads": grads}
            if mode == "trace":
                record["micro_rs"] = sum(str(n.target) == REDUCE_SCATTER for n in step.traced.gm.graph.nodes)
                record["update_rs"] = sum(str(n.target) == REDUCE_SCATTER for n in step.update.traced.gm.graph.nodes)
                record["units"] = len(fsdp.units)
            if rank == 0:
                torch.save(record, Path(out, f"{sync}_{mode}.pt"))
    finally:
        if mesh is not None:
            destroy(mesh)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp_accumulation")
    spawn_ranks(_worker, WORLD, (free_port(), str(out)), timeout_s=600)
    return {(sync, mode): torch.load(out / f"{sync}_{mode}.pt") for sync in SYNCS for mode in ("eager", "trace")}


@pytest.mark.parametrize("sync", SYNCS)
def test_fsdp_accumulation_is_bitwise_with_eager_fsdp_and_reduces_where_asked(runs, sync):
    eager, traced = runs[(sync, "eager")], runs[(sync, "trace")]
    assert torch.equal(eager["loss"], traced["loss"])
    for name, g in eager["grads"].items():
        assert torch.equal(g, traced["grads"][name]), name
    per_micro, per_step = (traced["units"], 0) if sync == "micro_batch" else (0, traced["units"])
    assert (traced["micro_rs"], traced["update_rs"]) == (per_micro, per_step)


@pytest.fixture(scope="module")
def one_process() -> tuple:
    """One process's loss and gradients on the whole global batch (no accumulation)."""
    return _grads(_job("--training.max_norm", "0", local=K * B, steps=1), _batch())


@pytest.mark.parametrize("sync", SYNCS)
def test_fsdp_accumulation_matches_one_process_on_the_whole_global_batch(runs, one_process, sync):
    traced = runs[(sync, "trace")]
    big_loss, big = one_process
    torch.testing.assert_close(traced["loss"], big_loss, rtol=RTOL, atol=ATOL)
    for name, g in traced["grads"].items():
        torch.testing.assert_close(g, big[name], rtol=RTOL, atol=ATOL, msg=name)
