"""FSDP (`parallelism.dp_shard`) over 2 processes (gloo on CPU): sharded state, gathers in the step graph.

Claims tested:
- traced FSDP == our eager FSDP bitwise over 5 steps (losses and every rank's final shards), in AC modes
  none/selective/full, with the optimizer in the graph, and for every gather policy;
- within tolerance of PyTorch's own FSDP2 (`fully_shard`) and of one process on the same global batch;
- the final graph holds one all-gather per unit in the forward, one reduce-scatter per unit in the backward,
  one all-reduce (the global grad norm), and in the backward one more all-gather per re-gathered unit;
- per rank, parameters + gradients + AdamW state <= (1/N + 5%) of one process's, and the measured step
  peak equals the estimate to the byte.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graph_trainer.tracer import node_meta
from graph_trainer.trainer import Trainer
from tests.multiprocess import (
    assert_bitwise_equal_runs,
    assert_peaks_match,
    free_port,
    peaks,
    save_full_params,
    spawn_ranks,
    state_bytes,
    step_graph_nodes,
    train_fully_shard,
    train_one_process,
    train_runs,
)
from tests.tiny import DETERMINISTIC, TINY_BATCH, tiny_model

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # 8 trainings of 3 steps on 2 ranks, then FSDP2: about a minute on 2 cores
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]

STEPS = 3  # enough for the clip, the schedule's warmup and AdamW's state to take part (CI time)
LAYERS = 2
UNITS = LAYERS + 1  # one per layer, plus the root (embeddings, final norm, output projection)
TINY = ["--config", "llama3_debug", *tiny_model(LAYERS), *TINY_BATCH, *DETERMINISTIC]
TINY += ["--training.steps", str(STEPS), "--training.max_norm", "1.0"]
TRACE = ["--compile.mode", "trace"]
RUNS = {
    "eager": ["--compile.mode", "eager"],
    "eager_full": ["--compile.mode", "eager", "--activation_checkpoint.mode", "full"],
    "trace": TRACE,
    "trace_selective": [*TRACE, "--activation_checkpoint.mode", "selective"],
    "trace_full": [*TRACE, "--activation_checkpoint.mode", "full"],
    "trace_optimizer": [*TRACE, "--compile.trace_optimizer", "true"],
    "trace_always": [*TRACE, "--parallelism.fsdp_reshard_after_forward", "always"],
    "trace_never": [*TRACE, "--parallelism.fsdp_reshard_after_forward", "never"],
    "trace_prefetch": [*TRACE, "--parallelism.fsdp_prefetch", "true"],
    # The budget keeps room for the gathers the prefetch moves after it decided (passes/budget.py).
    "trace_budget_prefetch": [
        *TRACE,
        "--parallelism.fsdp_prefetch",
        "true",
        "--activation_checkpoint.mode",
        "budget",
        "--activation_checkpoint.memory_budget",
        "0.9",
    ],
    # Compiled region by region, the prefetched gathers cross region boundaries. Not bitwise: see its test.
    "trace_inductor": [
        *TRACE,
        "--compile.backend",
        "inductor",
        "--compile.trace_optimizer",
        "true",
        "--parallelism.fsdp_prefetch",
        "true",
    ],
}
BITWISE_RUNS = [r for r in RUNS if r not in ("eager", "trace_inductor")]
# 4 ranks on 2 cores are slow: only the runs the 4-rank claims need (vocab 258 pads at 4 ranks, not at 2).
RUNS_AT = {2: RUNS, 4: {name: RUNS[name] for name in ("eager", "trace", "trace_full")}}
TIMEOUT_S = 420
GATHER, REDUCE_SCATTER, ALL_REDUCE = (
    "_c10d_functional.all_gather_into_tensor_out.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_reduce.default",
)


def _fully_shard_reference(cfg, out: str, rank: int, world: int) -> None:
    """The same job trained with torch's FSDP2 (`fully_shard`): its losses and final full parameters, to files."""
    losses, full = train_fully_shard(cfg, rank, world)
    if rank == 0:
        torch.save(full, Path(out, "fully_shard.params.pt"))
        Path(out, "fully_shard.json").write_text(json.dumps({"losses": losses}))


def _compile_in_turn(out: str) -> Callable[[str, Trainer], None]:
    """An `on_built` hook: the ranks compile the Inductor run's step one after another, so that rank 0's kernels
    serve the others from Inductor's cache (the test's processes share `TORCHINDUCTOR_CACHE_DIR`).

    Both ranks compiling at once spent 2 x 52 s of CPU on 2 cores, cold cache; in turn 56 s + 12 s. The step is
    prepared on zeros of the batch's shape: a signature that differed from the loader's would retrace, which
    `test_fsdp_compiled_by_inductor_follows_the_traced_step` refuses (`trace_count == 1`)."""

    def hook(name: str, trainer: Trainer) -> None:
        if name != "trace_inductor":
            return
        rank, training = trainer.rank, trainer.cfg.training
        while rank > 0 and not Path(out, f"compiled.rank{rank - 1}").exists():
            time.sleep(0.1)
        tokens = torch.zeros(training.local_batch_size, training.seq_len, dtype=torch.long)
        trainer.step_fn.prepare({"input": tokens, "labels": tokens})
        Path(out, f"compiled.rank{rank}").touch()

    return hook


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: train every run of RUNS_AT[world] (then FSDP2) and write what the tests compare."""
    args = [*TINY, "--parallelism.dp_shard", str(world)]
    reference = lambda cfg: _fully_shard_reference(cfg, out, rank, world)  # noqa: E731
    runs = train_runs(
        rank, world, port, RUNS_AT[world], args, out, before_leaving=reference, on_built=_compile_in_turn(out)
    )
    for name, trainer, result in runs:
        record = {
            "losses": result.losses,
            "params": result.params_sha256,
            "trace_count": result.trace_count,
            "collectives": [
                (str(n.target), node_meta.phase(n), node_meta.is_rematerialized(n))
                for n in step_graph_nodes(trainer)
                if "c10d" in str(n.target)
            ],
            "state_bytes": state_bytes(trainer),
            "peaks": peaks(result.records),
        }
        Path(out, f"{name}.rank{rank}.json").write_text(json.dumps(record))
        save_full_params(trainer, out, name, rank)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request, tmp_path_factory) -> tuple[int, Path]:
    """(world size, the folder with the records of every run in RUNS_AT[world], trained by that many ranks)."""
    world = request.param
    out = tmp_path_factory.mktemp(f"fsdp{world}")
    spawn_ranks(_worker, world, (world, free_port(), str(out)), TIMEOUT_S)
    return world, out


def _runs(ranks: tuple[int, Path], run: str) -> tuple[int, Path]:
    world, out = ranks
    if run not in RUNS_AT[world]:
        pytest.skip(f"{run} is trained at 2 ranks only")
    return world, out


def _record(out: Path, run: str, rank: int = 0) -> dict:
    return json.loads((out / f"{run}.rank{rank}.json").read_text())


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("run", BITWISE_RUNS)
def test_fsdp_traced_equals_eager_fsdp_bitwise_on_every_rank(ranks, run):
    world, out = _runs(ranks, run)
    for rank in range(world):
        assert_bitwise_equal_runs(_record(out, "eager", rank), _record(out, run, rank), STEPS, run)


def test_fsdp_compiled_by_inductor_follows_the_traced_step(ranks):
    """`compile.backend = inductor` with FSDP: the gathers into the shard's own buffer are compiled as the
    functional all-gather, and with prefetch a gather is issued in one region and waited in the next.
    Numerics as `tests/compiler/test_compiled.py` declares them: each step's loss within 1e-4 relative of the
    uncompiled traced step (same optimizer placement), every rank logging the same loss."""
    world, out = _runs(ranks, "trace_inductor")
    reference = _record(out, "trace_optimizer")["losses"]
    records = [_record(out, "trace_inductor", rank) for rank in range(world)]
    assert len(records[0]["losses"]) == STEPS and records[0]["trace_count"] == 1
    assert records[0]["losses"] == pytest.approx(reference, rel=1e-4)
    assert all(r["losses"] == records[0]["losses"] for r in records)
    # The functional gather's own buffer is in the estimate (`functional_gather_bytes`): still a bound.
    for rank, record in enumerate(records):
        uncompiled = _record(out, "trace_optimizer", rank)["peaks"]
        for (estimated, measured, late), (plain_estimate, _, _) in zip(record["peaks"], uncompiled, strict=True):
            assert measured <= estimated + late, (rank, record["peaks"])
            assert estimated > plain_estimate


def test_ranks_hold_different_shards_and_log_the_same_loss(ranks):
    world, out = ranks
    records = [_record(out, "trace", rank) for rank in range(world)]
    assert len({r["params"] for r in records}) == world
    assert all(r["losses"] == records[0]["losses"] for r in records)


def test_fsdp_close_to_torch_fully_shard(ranks):
    """Tolerance 1e-6 absolute on parameters after 5 steps (measured max 6e-8 at 2 ranks: reduction order only)."""
    world, out = ranks
    diff = _max_diff(torch.load(out / "trace.params.pt"), torch.load(out / "fully_shard.params.pt"))
    print(f"{world} ranks: max |param - fully_shard param| after {STEPS} steps: {diff:.3g}")
    assert diff < 1e-6
    losses = json.loads((out / "fully_shard.json").read_text())["losses"]
    assert _record(out, "trace")["losses"] == pytest.approx(losses, rel=1e-5)


def test_fsdp_close_to_one_process_with_the_global_batch(ranks, tmp_path):
    """N ranks x batch 2 vs 1 process x batch 2N: same up to summation order (1e-6 on params, 1e-5 on losses);
    per rank, parameters + gradients + AdamW state <= (1/N + 5%) of the one process's."""
    world, out = ranks
    trainer, single = train_one_process([*TINY, "--training.local_batch_size", str(2 * world)], str(tmp_path))
    diff = _max_diff(torch.load(out / "trace.params.pt"), {n: p.detach() for n, p in trainer.model.named_parameters()})
    print(f"{world} ranks: max |param - one-process param| after {STEPS} steps: {diff:.3g}")
    assert diff < 1e-6
    assert _record(out, "trace")["losses"] == pytest.approx(single.losses, rel=1e-5)
    one_process = state_bytes(trainer)
    for rank in range(world):
        state = _record(out, "trace", rank)["state_bytes"]
        print(f"{world} ranks: rank {rank} holds {state:,} bytes of state, one process {one_process:,}")
        assert state <= (1 / world + 0.05) * one_process


@pytest.mark.parametrize("run", [r for r in BITWISE_RUNS if r.startswith("trace")])
def test_measured_step_peak_equals_estimate_per_rank(ranks, run):
    world, out = _runs(ranks, run)
    for rank in range(world):
        assert_peaks_match(_record(out, run, rank)["peaks"], (run, rank))


@pytest.mark.parametrize(
    "run,backward_gathers",
    [
        ("trace", LAYERS),
        ("trace_always", UNITS),
        ("trace_never", 0),
        ("trace_full", LAYERS),
        ("trace_selective", LAYERS),
        ("trace_prefetch", LAYERS),
    ],
)
def test_collective_counts_follow_the_gather_policy(ranks, run, backward_gathers):
    _, out = _runs(ranks, run)
    collectives = _record(out, run)["collectives"]

    def count(target: str, phase: str, regathered: bool = False) -> int:
        return sum(1 for t, p, r in collectives if t == target and p == phase and r == regathered)

    assert count(GATHER, node_meta.FORWARD) == UNITS
    # The backward's gathers are the forward's, copied by remat (they keep the forward's phase tag).
    assert count(GATHER, node_meta.FORWARD, regathered=True) == backward_gathers
    assert count(REDUCE_SCATTER, node_meta.BACKWARD) == UNITS
    assert len(collectives) == 2 * (2 * UNITS + backward_gathers + 1)  # each with its wait_tensor
    assert [p for t, p, _ in collectives if t == ALL_REDUCE] == [node_meta.OPTIMIZER]  # the global grad norm


def test_regathering_lowers_the_estimated_peak(ranks):
    _, out = _runs(ranks, "trace_always")

    def peak(run: str) -> int:
        return _record(out, run)["peaks"][0][0]

    assert peak("trace_always") < peak("trace_never")
