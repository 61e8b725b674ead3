"""Gradient accumulation with tensor parallelism (`parallelism.tp 2`, alone and with `dp_shard 2`; gloo).

Claims tested, on the global batch of tests/test_accumulation.py, whose micro-batches hold very uneven numbers of
valid tokens, with a vocabulary (259) that tp 2 pads (so a padding logit is masked throughout):
- the traced accumulated step's loss and whole gradients (the ranks' blocks gathered) are bitwise equal to eager
  accumulation through the same vocabulary-parallel loss, with the plain and the chunked loss (tp 2), and with
  FSDP's gradients reduce-scattered every micro-batch or once per step (tp 2 x dp_shard 2);
- the norms' gradients (whole on every tp rank, each from its tokens) are all-reduced over tp once per step, in
  the update graph, in both `fsdp_grad_sync` modes, after FSDP's reduce-scatter of the sums in "step";
- all of them equal one process's step on the whole global batch within tests/test_accumulation.py's
  tolerance: the vocabulary-parallel loss is normalised by the step's valid tokens over every micro-batch and
  data-parallel rank (not the world: tp peers read the same batch), not by a mean of means.
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
from graph_trainer.tracer import node_meta
from tests.multiprocess import free_port, spawn_ranks
from tests.test_accumulation import ATOL, BASE, RTOL, B, K, _batch, _grads, _job

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # 2 and 4 ranks trace and run accumulated steps: about a minute each on 2 cores
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]
TP, LAYERS = 2, 2
VOCAB = ["--model.vocab_size", "259"]  # the byte tokenizer's 258 ids + 1: tp 2 pads it to 260
CHUNKED = ["--training.loss_chunk_size", "24"]  # micro-batches of 64 tokens: chunks of 24, 24 and 16
# (name, world, overrides): tp alone with the plain and the chunked loss; tp x dp_shard in both sync modes.
RUNS = [
    *((f"tp_{mode}", TP, ["--compile.mode", mode]) for mode in ("eager", "trace")),
    *((f"tp_chunked_{mode}", TP, ["--compile.mode", mode, *CHUNKED]) for mode in ("eager", "trace")),
    *(
        (f"2d_{sync}_{mode}", 2 * TP, ["--compile.mode", mode, "--parallelism.fsdp_grad_sync", sync])
        for sync in ("micro_batch", "step")
        for mode in ("eager", "trace")
    ),
]


def whole_grads(job) -> dict[str, torch.Tensor]:
    """Every parameter's gradient whole (a collective): FSDP's shards gathered, then TP's blocks (padding cut)."""
    grads = {n: p.grad for n, p in job.model.named_parameters()}
    parts = {p.kind: p for p in job.parallel.parts}
    if "fsdp" in parts:
        fsdp = parts["fsdp"]
        for unit in fsdp.units:
            grads.update(zip(unit.param_names, _gather(unit, fsdp.group, [p.grad for p in unit.current()], None, None)))
    return parts["tp"].full_state(grads)


def _collectives(gm: torch.fx.GraphModule, kind: str, role: str, op: str) -> int:
    """How many `op` collectives of the graph carry the tag (kind, role)."""
    found = 0
    for n in gm.graph.nodes:
        tag = node_meta.collective(n)
        found += tag is not None and (tag["kind"], tag["role"]) == (kind, role) and op in str(n.target)
    return found


def _where_reduced(step) -> dict[str, int]:
    """The gradient reductions of the micro graph and of the update graph: TP's all-reduces of the norms'
    gradients, FSDP's reduce-scatters."""
    out = {}
    for part, gm in (("micro", step.traced.gm), ("update", step.update.traced.gm)):
        out[f"{part}_tp"] = _collectives(gm, "tp", node_meta.GRAD_REDUCE, "all_reduce")
        out[f"{part}_fsdp"] = _collectives(gm, "fsdp", node_meta.GRAD_REDUCE, "reduce_scatter")
    return out


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    data = world // TP
    args = [*BASE, *VOCAB, "--parallelism.tp", str(TP), "--parallelism.dp_shard", str(data)]
    args += ["--training.max_norm", "0", "--training.local_batch_size", str(B)]
    args += ["--training.global_batch_size", str(K * B)]
    mesh = None
    try:
        # tp is the innermost mesh dimension: ranks 2d and 2d + 1 are data-parallel rank d and read its slice.
        batch = {k: v.chunk(data)[rank // TP] for k, v in _batch().items()}
        for name, _, overrides in (r for r in RUNS if r[1] == world):
            cfg, _ = load_config([*args, *overrides])
            mesh = mesh or init_distributed(cfg)
            job = build_job(cfg, mesh)
            step = job.build_step(optimizer_update=False)
            loss, _ = step(batch)
            record = {"loss": mesh.global_average(loss), "grads": whole_grads(job)}
            if cfg.compile.mode == "trace":
                record.update(_where_reduced(step))
            if rank == 0:
                torch.save(record, Path(out, f"{name}.pt"))
    finally:
        if mesh is not None:
            destroy(mesh)


def _spawn(tmp_path_factory, world: int) -> dict:
    out = tmp_path_factory.mktemp(f"tp_accumulation_{world}")
    spawn_ranks(_worker, world, (world, free_port(), str(out)), timeout_s=600)
    return {name: torch.load(out / f"{name}.pt") for name, w, _ in RUNS if w == world}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return _spawn(tmp_path_factory, TP)


@pytest.fixture(scope="module")
def runs_2d(tmp_path_factory) -> dict:
    return _spawn(tmp_path_factory, 2 * TP)


@pytest.fixture(scope="module")
def one_process() -> tuple:
    """One process's loss and gradients on the whole global batch (no accumulation, no tp)."""
    return _grads(_job("--training.max_norm", "0", *VOCAB, local=K * B, steps=1), _batch())


def _assert_bitwise(eager: dict, traced: dict) -> None:
    assert torch.equal(eager["loss"], traced["loss"])
    for name, g in eager["grads"].items():
        assert torch.equal(g, traced["grads"][name]), name


def _assert_close_to_one_process(traced: dict, one_process: tuple) -> None:
    big_loss, big = one_process
    worst = max((g - big[n]).abs().max().item() for n, g in traced["grads"].items())
    print(f"loss {traced['loss'].item():.8g} vs {big_loss.item():.8g}; max |grad - one-process grad| {worst:.3g}")
    torch.testing.assert_close(traced["loss"], big_loss, rtol=RTOL, atol=ATOL)
    assert traced["grads"].keys() == big.keys()
    for name, g in traced["grads"].items():
        torch.testing.assert_close(g, big[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_tp_accumulation_is_bitwise_with_eager_and_reduces_the_norms_once_per_step(runs, loss):
    prefix = "tp_" if loss == "plain" else "tp_chunked_"
    eager, traced = runs[f"{prefix}eager"], runs[f"{prefix}trace"]
    _assert_bitwise(eager, traced)
    assert (traced["micro_tp"], traced["update_tp"]) == (0, 2 * LAYERS + 1)  # the norms, in the update graph


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_tp_accumulation_matches_one_process_on_the_whole_batch(runs, one_process, loss):
    """Within tests/test_accumulation.py's tolerance (1e-5 relative: summation order only; a mean of micro-batch
    means misses by more than 100 times it). The chunked loss adds its own summation order, which
    tests/test_loss.py bounds at the same 1e-5."""
    _assert_close_to_one_process(runs["tp_trace" if loss == "plain" else "tp_chunked_trace"], one_process)


@pytest.mark.parametrize("sync", ["micro_batch", "step"])
def test_tp_with_fsdp_accumulation_is_bitwise_with_eager_in_both_sync_modes(runs_2d, sync):
    eager, traced = runs_2d[f"2d_{sync}_eager"], runs_2d[f"2d_{sync}_trace"]
    _assert_bitwise(eager, traced)
    units = LAYERS + 1  # FSDP's units: the layers and the root
    fsdp = (units, 0) if sync == "micro_batch" else (0, units)
    assert (traced["micro_fsdp"], traced["update_fsdp"]) == fsdp
    assert (traced["micro_tp"], traced["update_tp"]) == (0, 2 * LAYERS + 1)


@pytest.mark.parametrize("sync", ["micro_batch", "step"])
def test_tp_with_fsdp_accumulation_matches_one_process_on_the_whole_global_batch(runs_2d, one_process, sync):
    """The same tolerance as at tp alone; FSDP's mean over the data ranks adds one division by 2 (exact)."""
    _assert_close_to_one_process(runs_2d[f"2d_{sync}_trace"], one_process)
