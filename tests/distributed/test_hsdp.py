"""HSDP (`parallelism.dp_replicate` 2 x `parallelism.dp_shard` 2): replicas of a sharded model, 4 gloo ranks on CPU.

Rank r is replica r // 2, shard r % 2. The backward's reduce-scatters average each gradient over its replica's
shards; the replicas then average the shards over dp_replicate (`distributed/replicate.py`).

Claims tested, on a 6-block Llama so that the preflight plans depth-free:
- traced == our eager HSDP bitwise on every rank (losses and final shards), one trace, the traced run resumed
  from its own HSDP checkpoint half-way;
- the replicas hold the same shards, the shards of one replica differ, every rank logs the same loss;
- within FSDP's tolerance of one process on the same global batch;
- every rank's measured step peak equals the preflight's depth-free estimate to the byte;
- the graph holds one reduce-scatter per FSDP unit and one replica all-reduce per gradient shard, each tagged
  with its parameter's block;
- the HSDP checkpoint also resumes as dp_shard 4 (the same data ranks and global batch) within FSDP's
  tolerance, and holds each replicated chunk once;
- DeepSeek-V3 with HSDP and ep 2: the balancing counts are summed over both data-parallel dimensions (every
  rank's tokens counted once, the bias equal on every rank) and traced == eager bitwise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graph_trainer.tracer import node_meta
from tests.multiprocess import (
    LogLines,
    assert_bitwise_equal_runs,
    assert_peaks_match,
    free_port,
    max_param_diff,
    peaks,
    save_full_params,
    spawn_ranks,
    step_graph_nodes,
    train_one_process,
    train_runs,
)
from tests.tiny import DETERMINISTIC, TINY_BATCH, tiny_model

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # 4 ranks train 6 short runs: about 2 minutes on 2 cores
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]

WORLD, REPLICAS, SHARDS = 4, 2, 2
STEPS = 3
LAYERS = 6  # real depth: the preflight plans from 3 + 4 blocks
UNITS = LAYERS + 1  # FSDP units: one per block, plus the root
HSDP = ["--parallelism.dp_replicate", str(REPLICAS), "--parallelism.dp_shard", str(SHARDS)]
# No decay horizon, so a 2-step run resumed to 3 steps equals a 3-step run.
COMMON = [*TINY_BATCH, *DETERMINISTIC, "--training.steps", str(STEPS), "--lr_scheduler.decay_type", "none"]
ONE_PROCESS = ["--config", "llama3_debug", *tiny_model(LAYERS), "--training.max_norm", "1.0", *COMMON]
LLAMA = [*ONE_PROCESS, *HSDP]
CHECKPOINT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "10"]
TRACE = ["--compile.mode", "trace"]
# ep 2 inside dp_shard 2, a capacity factor of ep so that no row is dropped.
MOE = ["--config", "deepseek_v3_debug", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4"]
MOE += [*COMMON, *HSDP, "--parallelism.ep", "2", "--parallelism.ep_capacity_factor", "2"]
# Summation order only (the gradients averaged over 2 x 2 ranks instead of summed over one batch of 8): FSDP's
# bounds (tests/distributed/test_fsdp.py). Measured on this CPU after 3 steps: against one process 5.1e-7 on the
# parameters (AdamW's first steps divide each gradient element by its own magnitude, so the rounding of near-zero
# elements grows towards the learning rate) and 8.7e-8 relative on the losses; resumed as dp_shard 4, 1.5e-8.
PARAMS_ATOL, LOSS_RTOL = 1e-6, 1e-5
REDUCE_SCATTER, ALL_REDUCE = "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_reduce.default"


def _runs(half: str, four: str) -> dict[str, list[str]]:
    return {
        "eager": ["--compile.mode", "eager"],
        # the traced run, in two parts: steps 1-2, then resumed from its step-2 checkpoint for step 3
        "first": [*TRACE, *CHECKPOINT, "--training.steps", "2", "--job.dump_folder", half],
        "resumed": [*TRACE, *CHECKPOINT, "--checkpoint.resume", "true", "--job.dump_folder", half],
        # the step-2 checkpoint, copied after `first`, resumed as FSDP over all 4 ranks
        "as_dp_shard_4": [*TRACE, "--parallelism.dp_replicate", "1", "--parallelism.dp_shard", str(WORLD),
                          "--checkpoint.enable", "true", "--checkpoint.resume", "true", "--job.dump_folder", four],
    }  # fmt: skip


MOE_RUNS = {"moe_eager": [*MOE, "--compile.mode", "eager"], "moe_trace": [*MOE, *TRACE]}


def _collectives(trainer) -> list[tuple[str, str | None, int | None]]:
    """(target, collective kind, layer tag) of each collective node of the step graph."""
    return [
        (str(n.target), node_meta.collective_kind(n), node_meta.layer_id(n))
        for n in step_graph_nodes(trainer)
        if str(n.target) in (REDUCE_SCATTER, ALL_REDUCE)
    ]


def _worker(rank: int, port: int, out: str) -> None:
    lines = LogLines()
    half, four = Path(out, "half"), Path(out, "four")
    runs = {name: [*LLAMA, *overrides] for name, overrides in _runs(str(half), str(four)).items()}
    runs |= MOE_RUNS
    for name, trainer, result in train_runs(rank, WORLD, port, runs, [], out):
        record = {
            "losses": result.losses,
            "params": result.params_sha256,
            "trace_count": result.trace_count,
            "peaks": peaks(result.records),
            "collectives": _collectives(trainer),
            "lines": lines.lines,
        }
        if name.startswith("moe"):
            routers = trainer.model.routers()
            record["bias"] = [r.expert_bias.tolist() for r in routers]
            record["counts"] = [r.tokens_per_expert.tolist() for r in routers]
        else:
            save_full_params(trainer, out, name, rank)
        Path(out, f"{name}.rank{rank}.json").write_text(json.dumps(record))
        lines.lines = []
        if name == "first":  # the step-2 checkpoint for the dp_shard 4 resume, before `resumed` adds step 3
            if rank == 0:
                step = "checkpoint/step-00000002.dcp"
                shutil.copytree(half / step, four / step)
                shutil.copy(half / "config.toml", four)
            dist.barrier()


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hsdp")
    spawn_ranks(_worker, WORLD, (free_port(), str(folder)), 900)
    return folder


def _record(out: Path, name: str, rank: int = 0) -> dict:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def _params(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.params.pt")


def test_traced_equals_eager_hsdp_bitwise_on_every_rank_through_a_checkpoint(out):
    """The traced run is steps 1-2, then a resume from its step-2 checkpoint on HSDP: together bitwise the eager
    run (losses, every rank's final shards), one trace each."""
    for rank in range(WORLD):
        eager, first, resumed = (_record(out, name, rank) for name in ("eager", "first", "resumed"))
        assert first["losses"] == eager["losses"][:2] and resumed["losses"] == eager["losses"][2:]
        assert resumed["params"] == eager["params"]  # this rank's final shards
        assert first["trace_count"] == resumed["trace_count"] == 1


def test_traced_equals_eager_hsdp_bitwise_with_experts_on_every_rank(out):
    for rank in range(WORLD):
        assert_bitwise_equal_runs(_record(out, "moe_eager", rank), _record(out, "moe_trace", rank), STEPS, "trace")


def test_replicas_hold_the_same_shards_and_every_rank_logs_the_same_loss(out):
    records = [_record(out, "eager", rank) for rank in range(WORLD)]
    shards = [r["params"] for r in records]
    for rank in range(WORLD):
        replica, shard = divmod(rank, SHARDS)
        assert shards[rank] == shards[shard]  # replica 0's holder of the same shard
        assert shards[rank] != shards[replica * SHARDS + (1 - shard)]  # the other shard of its replica
    assert all(r["losses"] == records[0]["losses"] for r in records)


def test_hsdp_is_one_process_on_the_same_global_batch(out, tmp_path):
    trainer, one = train_one_process([*ONE_PROCESS, "--training.local_batch_size", str(2 * WORLD)], str(tmp_path))
    ours = _record(out, "eager")["losses"]  # bitwise the traced run's (above)
    diff = max_param_diff(_params(out, "eager"), {n: p.detach() for n, p in trainer.model.named_parameters()})
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(ours, one.losses, strict=True))
    print(f"\nHSDP 2 x 2 vs one process (batch 8): max |param diff| {diff:.3g}, max loss rel diff {loss_rel:.3g}")
    assert diff < PARAMS_ATOL
    assert ours == pytest.approx(one.losses, rel=LOSS_RTOL)


def test_every_rank_peak_equals_its_depth_free_estimate(out):
    assert (
        f"preflight: depth-free plan, models of 3 + 4 blocks traced for a model of {LAYERS}"
        in _record(out, "first")["lines"]
    )
    for name in ("first", "resumed", "as_dp_shard_4", "moe_trace"):
        for rank in range(WORLD):
            assert_peaks_match(_record(out, name, rank)["peaks"], (name, rank))


def test_each_gradient_shard_is_averaged_over_the_replicas_inside_its_block(out):
    collectives = _record(out, "first")["collectives"]
    trainable = len(_params(out, "eager"))  # the tiny Llama ties no weights: one gradient per parameter
    replica_means = [layer for target, kind, layer in collectives if kind == "dp_replicate" and target == ALL_REDUCE]
    assert len(replica_means) == trainable
    assert {layer for layer in replica_means if layer is not None} == set(range(LAYERS))
    assert sum(1 for target, kind, _ in collectives if kind == "fsdp" and target == REDUCE_SCATTER) == UNITS


def test_an_hsdp_checkpoint_resumes_as_dp_shard_4(out):
    # dp_shard 4 reads as data ranks 0..3 what HSDP's replica x shard ranks read: the same global batch
    resharded = _record(out, "as_dp_shard_4")["losses"]
    assert resharded == pytest.approx(_record(out, "eager")["losses"][2:], rel=LOSS_RTOL)
    diff = max_param_diff(_params(out, "as_dp_shard_4"), _params(out, "eager"))
    print(f"\nHSDP step-2 checkpoint resumed as dp_shard 4: max |param diff| at step {STEPS} {diff:.3g}")
    assert diff < PARAMS_ATOL


def test_the_replicas_write_each_chunk_of_the_checkpoint_once(out):
    """DCP drops the chunks the replicas hold twice: the HSDP checkpoint is no bigger than dp_shard 4's of the
    same step (measured 5.46 MB against 6.00 MB), where a copy per replica would double it."""

    def tensor_bytes(folder: Path) -> int:
        return sum(f.stat().st_size for f in folder.glob("__*_0.distcp"))

    step = f"checkpoint/step-{STEPS:08d}.dcp"
    hsdp, fsdp = tensor_bytes(out / "half" / step), tensor_bytes(out / "four" / step)
    assert len(list((out / "half" / step).glob("__*_0.distcp"))) == WORLD
    assert hsdp <= 1.05 * fsdp, (hsdp, fsdp)


def test_moe_balancing_counts_are_summed_over_both_data_parallel_dimensions(out):
    records = [_record(out, "moe_trace", rank) for rank in range(WORLD)]
    assert all(r["bias"] == records[0]["bias"] for r in records)
    assert any(v != 0 for layer in records[0]["bias"] for v in layer)
    # every (token, choice) of the 4 ranks x 2 sequences x 32 tokens x top-2, counted once
    assert all(r["counts"] == records[0]["counts"] for r in records)
    assert sum(records[0]["counts"][0]) == WORLD * 2 * 32 * 2
