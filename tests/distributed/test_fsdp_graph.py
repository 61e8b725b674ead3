"""FSDP's step graph, traced for one rank of 2 on torch's fake process group (one process, no communication).

Claims tested: one all-gather per unit in the forward and one reduce-scatter per unit in the backward, and
the backward's re-gathers follow `parallelism.fsdp_reshard_after_forward` in every AC mode, after remat; a
tied model gathers its shared weight once and reads no shard anywhere but in a gather; a parameter read
outside its gather stops the trace with an error naming it; `--dry-run --parallelism.dp_shard N` plans one
rank of N without launching N processes; with `training.mixed_precision_param = bfloat16` every all-gather
moves bf16, the reduce-scatters run in `mixed_precision_reduce`, and the shards and their gradients stay fp32.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from graph_trainer.builder import build_job
from graph_trainer.distributed.fsdp import check_gathered
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.job_config.cli import load_config
from graph_trainer.loss import build_lm_loss, lm_loss
from graph_trainer.passes import build_pipeline
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TraceError, trace_step
from tests.tiny import TINY_BATCH, tiny_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

REPO = Path(__file__).resolve().parents[2]
LAYERS = 2
UNITS = LAYERS + 1
TINY = ["--config", "llama3_debug", *tiny_model(LAYERS), *TINY_BATCH, "--training.max_norm", "1.0"]
TINY += ["--parallelism.dp_shard", "2"]
GATHER = "_c10d_functional.all_gather_into_tensor_out.default"
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"
ALL_REDUCE = "_c10d_functional.all_reduce.default"


@pytest.fixture(scope="module")
def group():
    """Rank 0 of 2 on torch's fake process group: the mesh every trace of this module is planned on."""
    cfg, _ = load_config(TINY)
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
        yield mesh


def _trace(mesh, *args: str, loss_fn=lm_loss):
    cfg, _ = load_config([*TINY, *args])
    job = build_job(cfg, mesh, materialize=False)
    (fsdp,) = job.parallel.parts
    b, s = cfg.training.local_batch_size, cfg.training.seq_len
    batch = {"input": torch.zeros(b, s, dtype=torch.long), "labels": torch.zeros(b, s, dtype=torch.long)}
    traced = trace_step(
        job.model,
        batch,
        loss_fn=job.parallel.wrap_loss(loss_fn),
        max_norm=cfg.training.max_norm,
        device="cpu",
        norm_reduce=job.parallel.norm_reduce(),
    )
    return cfg, fsdp, traced


def _collectives(gm: torch.fx.GraphModule) -> Counter:
    """(op, phase, re-gathered by remat) -> count."""
    return Counter(
        (str(n.target), node_meta.phase(n), node_meta.is_rematerialized(n))
        for n in gm.graph.nodes
        if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)
    )


REGATHERED = {"default": LAYERS, "always": UNITS, "never": 0}


@pytest.mark.parametrize(
    "mode,policy",
    [
        ("none", "default"),
        ("none", "always"),
        ("none", "never"),
        ("selective", "default"),
        ("full", "default"),
        ("full", "never"),
        ("budget", "always"),
    ],
)
def test_final_graph_gathers_per_policy(group, mode, policy):
    regathered = REGATHERED[policy]
    cfg, _, traced = _trace(
        group,
        "--activation_checkpoint.mode",
        mode,
        "--activation_checkpoint.memory_budget",
        "0.8",
        "--parallelism.fsdp_reshard_after_forward",
        policy,
    )
    gm = build_pipeline(cfg, dump_dir=None)(check_gathered(traced)).traced.gm
    assert _collectives(gm) == Counter(
        {
            (GATHER, node_meta.FORWARD, False): UNITS,
            (REDUCE_SCATTER, node_meta.BACKWARD, False): UNITS,
            (ALL_REDUCE, node_meta.OPTIMIZER, False): 1,  # the global gradient norm
            **({(GATHER, node_meta.FORWARD, True): regathered} if regathered else {}),
        }
    )
    waits = sum(1 for n in gm.graph.nodes if str(n.target) == "_c10d_functional.wait_tensor.default")
    assert waits == 2 * UNITS + 1 + regathered
    # A re-gathered unit's forward gather is dead before the backward: nothing saved reads it.
    regathered_units = {
        node_meta.gathered_unit(n)
        for n in gm.graph.nodes
        if node_meta.is_rematerialized(n) and node_meta.gathered_unit(n) is not None
    }
    assert len(regathered_units) == regathered


def test_prefers_regathering_layers_for_memory(group):
    peaks = {}
    for policy in ("always", "never"):
        cfg, _, traced = _trace(group, "--parallelism.fsdp_reshard_after_forward", policy)
        peaks[policy] = build_pipeline(cfg, dump_dir=None)(traced).memory_estimate.peak_bytes
    assert peaks["always"] < peaks["never"]


def test_tied_model_gathers_the_shared_weight_once_and_reads_no_shard(group):
    cfg, fsdp, traced = _trace(group, "--model.tie_embeddings", "true")
    root = next(u for u in fsdp.units if u.name == "")
    tied = next(slots for slots in root.slots if len(slots) == 2)
    assert {attr for _, attr in tied} == {"weight"}  # tok_embeddings.weight and output.weight: one parameter
    assert check_gathered(traced) is traced
    gathers = [n for n in traced.gm.graph.nodes if str(n.target) == GATHER]
    assert sorted(node_meta.gathered_unit(n) for n in gathers) == sorted(u.name for u in fsdp.units)
    assert len(gathers) == UNITS


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_reading_a_parameter_outside_its_gather_names_it(group, param_dtype):
    def loss_with_regularizer(model, batch):
        # A layer weight used outside its layer's forward: here it is only this rank's shard.
        return lm_loss(model, batch) + 1e-4 * model.layers[0].feed_forward.w1.weight.square().sum()

    _, _, traced = _trace(group, "--training.mixed_precision_param", param_dtype, loss_fn=loss_with_regularizer)
    with pytest.raises(TraceError, match=r"parameter layers\.0\.feed_forward\.w1\.weight is read un-gathered"):
        check_gathered(traced)


@pytest.mark.integration  # two CLI dry runs of 4 modes each: about 30 s on an idle machine
def test_dry_run_plans_one_rank_of_n_without_launching_them(tmp_path):
    def dry_run(*args: str) -> str:
        # One wide layer at a tiny batch: its state (~0.2 GiB) dominates the plan, and it traces fast.
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "graph_trainer",
                "--config",
                "llama3_debug",
                "--model.n_layers",
                "1",
                "--model.dim",
                "1024",
                "--model.n_heads",
                "8",
                "--model.n_kv_heads",
                "8",
                "--training.seq_len",
                "16",
                "--training.local_batch_size",
                "1",
                "--dry-run",
                *args,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    def none_peak(out: str) -> float:
        return float(next(line.split()[1] for line in out.splitlines() if line.startswith("none ")))

    sharded = dry_run("--parallelism.dp_shard", "4")
    assert "one rank of 4 (FSDP, dp_shard)" in sharded
    assert all(
        any(line.startswith(mode + " ") for line in sharded.splitlines())
        for mode in ("none", "selective", "full", "budget")
    )
    assert none_peak(sharded) < none_peak(dry_run())


def test_prefetch_issues_each_gather_right_after_the_previous_wait(group):
    cfg, _, traced = _trace(group, "--parallelism.fsdp_prefetch", "true")
    gm = build_pipeline(cfg, dump_dir=None)(traced).traced.gm
    nodes = list(gm.graph.nodes)
    for rematerialized in (False, True):
        gathers = [n for n in nodes if str(n.target) == GATHER and node_meta.is_rematerialized(n) == rematerialized]
        assert len(gathers) == (LAYERS if rematerialized else UNITS)
        for previous, gather in pairwise(gathers):
            wait = next(u for u in previous.users if "wait_tensor" in str(u.target))
            between = nodes[nodes.index(wait) + 1 : nodes.index(gather)]
            # Only the gather's own buffer preparation sits between: no compute of the previous unit.
            assert all(node_meta.gathered_unit(n) == node_meta.gathered_unit(gather) for n in between), between


BF16 = ["--training.mixed_precision_param", "bfloat16"]


@pytest.mark.parametrize("reduce,chunk", [("float32", 0), ("bfloat16", 0), ("float32", 16)])
def test_bf16_params_gather_in_bf16_and_reduce_in_reduce_dtype(group, reduce, chunk):
    cfg, _, traced = _trace(
        group,
        *BF16,
        "--training.mixed_precision_reduce",
        reduce,
        "--activation_checkpoint.mode",
        "selective",
        loss_fn=build_lm_loss(chunk),
    )
    final = build_pipeline(cfg, dump_dir=None)(check_gathered(traced))
    gm = final.traced.gm
    dtypes = Counter(
        (str(n.target), n.meta["val"].dtype)
        for n in gm.graph.nodes
        if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)
    )
    reduce_dtype = getattr(torch, reduce)
    assert dtypes == Counter(
        {
            (GATHER, torch.bfloat16): UNITS + REGATHERED["default"],
            (REDUCE_SCATTER, reduce_dtype): UNITS,
            (ALL_REDUCE, torch.float32): 1,
        }
    )
    # The shards the step reads and the gradients it returns stay fp32 (AdamW and the clip work on them).
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][: len(traced.layout.param_names)]
    assert {n.meta["val"].dtype for n in placeholders} == {torch.float32}
    grads = pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0])[2:]
    assert len(grads) == len(traced.layout.grad_names)
    assert {g.meta["val"].dtype for g in grads} == {torch.float32}


def test_bf16_params_halve_the_gathered_bytes_and_lower_the_estimate(group):
    gathered, peaks = {}, {}
    for name, args in (("fp32", []), ("bf16", BF16)):
        cfg, fsdp, traced = _trace(group, *args)
        # As FSDP2, a param_dtype equal to the parameters' own is no cast at all.
        assert fsdp.param_dtype == (torch.bfloat16 if args else None)
        final = build_pipeline(cfg, dump_dir=None)(traced)
        gathered[name] = sum(n.meta["val"].nbytes for n in final.traced.gm.graph.nodes if str(n.target) == GATHER)
        peaks[name] = final.memory_estimate.peak_bytes
    assert gathered["bf16"] * 2 == gathered["fp32"]
    assert peaks["bf16"] < peaks["fp32"]
