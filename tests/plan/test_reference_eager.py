"""The reference table's eager figure (benchmarks/reference_table.py `eager_peak`): for a pinned FSDP layout with the
bf16 plan, it is `eager_step_peak` of that layout plus the AdamW update as the graph plan adds one (state alive
throughout, scratch on what the step leaves alive), and it counts the same optimizer as the graph plan."""

from __future__ import annotations

import torch

from benchmarks.reference_table import eager_peak
from graph_trainer.builder import build_job
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.job_config.cli import load_config
from graph_trainer.layouts import search
from graph_trainer.optimizer.update_memory import EagerUpdate
from graph_trainer.plan.eager_baseline import eager_step_peak

ARGS = ["--config", "llama3_debug", "--model.n_layers", "2", "--training.seq_len", "64", "--training.dtype", "bfloat16"]


def test_eager_figure_is_the_eager_step_plus_the_graph_plans_update():
    cfg, _ = load_config([*ARGS, "--training.loss_chunk_size", "0"])
    cpu = torch.device("cpu")
    # The benchmark's pinned rows: FSDP, selective AC, update out of the graph, prefetch.
    degrees, prefetch = (("dp_replicate", 1), ("dp_shard", 2)), (("fsdp_prefetch", True),)
    cand = search.Candidate(degrees, "selective", 2, 0, False, options=prefetch)
    plans = search.Plans(cfg, cpu)
    figure = eager_peak(cfg, cand, plans)

    layout = cand.micro().apply(cfg)
    assert layout.training.mixed_precision_param == "bfloat16"  # the bf16 plan the graph side plans
    step = eager_step_peak(layout, cpu)
    with planning_mesh(ParallelDims.from_config(layout.parallelism), cpu) as mesh:
        optimizer = build_job(layout, mesh, materialize=False).optimizer
        update = EagerUpdate.of(optimizer, "single_tensor", cpu)  # torch's own choice on CPU ("auto")
    assert update.state_bytes > 0 and update.scratch_bytes > 0
    assert figure == max(step.peak_bytes, step.end_bytes + update.scratch_bytes) + update.state_bytes

    # The graph plan of the same candidate counts the same optimizer: its implementation and its state.
    graph = plans.get(cand, ["selective"])["selective"]
    assert graph.optimizer == update.implementation
    assert graph.peak_by_category["optimizer_state"] == update.state_bytes
