"""The eager AdamW update: its implementation is chosen per device, and its scratch memory is modelled exactly.

The 8B run on an H200 died of OOM in torch's foreach AdamW after the preflight
said it fit, because the plan assumed the single-tensor update. These tests pin
the choice (fused on CUDA, single-tensor on CPU), check the scratch model of all
three implementations against the exact CPU tracker, and plan with the CUDA
choice without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from graph_trainer.builder import build_model
from graph_trainer.errors import ConfigError
from graph_trainer.job_config.cli import load_config
from graph_trainer.observability.memory import LiveTensorTracker
from graph_trainer.optimizer.adamw import GraphAdamW, build_optimizer, choose_adamw_implementation, init_adamw_state
from graph_trainer.optimizer.update_memory import EagerUpdate, adamw_state_bytes, eager_step_scratch_bytes
from graph_trainer.plan.step_plan import plan_config
from tests.integration.trainer_runs import TINY, train

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
IMPLEMENTATIONS = {"single_tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def test_auto_is_fused_on_cuda_and_single_tensor_on_cpu():
    assert choose_adamw_implementation("auto", CUDA, trace_optimizer=False) == "fused"
    assert choose_adamw_implementation("auto", CPU, trace_optimizer=False) == "single_tensor"
    # In the graph the update is the single-tensor algorithm on every device.
    assert choose_adamw_implementation("auto", CUDA, trace_optimizer=True) == "single_tensor"
    assert choose_adamw_implementation("foreach", CUDA, trace_optimizer=False) == "foreach"
    with pytest.raises(ConfigError, match="compile.trace_optimizer"):
        choose_adamw_implementation("fused", CUDA, trace_optimizer=True)


def test_built_optimizer_runs_the_chosen_implementation():
    model = torch.nn.Linear(4, 3)
    for name, flags in IMPLEMENTATIONS.items():
        group = build_optimizer(
            model, name="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation=name
        ).param_groups[0]
        assert bool(group["foreach"]) == flags.get("foreach", False)
        assert bool(group["fused"]) == flags.get("fused", False)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_scratch_model_equals_the_tracked_cpu_update(implementation):
    torch.manual_seed(0)
    # Two dtypes, so foreach makes two buckets; sizes out of order, so "previous" matters.
    params = [
        torch.randn(shape, dtype=dtype, requires_grad=True)
        for shape, dtype in [
            ((300, 7), torch.float32),
            ((5,), torch.float32),
            ((40, 3), torch.bfloat16),
            ((1000, 3), torch.float32),
            ((64, 64), torch.float32),
            ((9,), torch.bfloat16),
        ]
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **IMPLEMENTATIONS[implementation])
    for p in params:
        init_adamw_state(optimizer, p)
    tracker = LiveTensorTracker()
    tracker.track_existing([params, [p.grad for p in params], list(optimizer.state.values())])
    before = tracker.current_bytes
    with tracker:
        optimizer.step()
    measured = tracker.peak_bytes - before
    tracker.forget()
    modelled = eager_step_scratch_bytes(optimizer)
    assert modelled == measured
    if implementation == "fused":
        assert modelled == 0
    else:
        assert modelled > 0


def test_fused_state_keeps_its_step_on_the_parameter_device_as_torch_does():
    model = torch.nn.Linear(4, 3)
    fused = build_optimizer(
        model, name="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation="fused"
    )
    single = build_optimizer(model, name="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for p in model.parameters():
        assert init_adamw_state(fused, p)["step"].dtype == torch.float32
        assert init_adamw_state(single, p)["step"].device.type == "cpu"
    # On a CUDA device the host-side step counters of the non-fused update take no device memory.
    meta = torch.nn.Linear(4, 3, device="meta")
    opt = build_optimizer(meta, name="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for p in meta.parameters():
        init_adamw_state(opt, p)
    assert adamw_state_bytes(opt, CUDA) == 4 * 512  # exp_avg, exp_avg_sq of 48 B and 12 B: one 512 B block each
    assert adamw_state_bytes(opt, CPU) == 2 * (12 + 3) * 4 + 2 * 4


def test_8b_cuda_choice_needs_no_scratch_where_foreach_needed_all_parameters():
    """Why the H200 run died: foreach's `_foreach_sqrt` holds a copy of every parameter (29.9 GiB)."""
    cfg, _ = load_config(["--config", "llama3_8b"])
    model = build_model(cfg, None)  # on the meta device
    implementation = choose_adamw_implementation(cfg.optimizer.implementation, CUDA, trace_optimizer=False)
    assert implementation == "fused"

    def update(name: str) -> EagerUpdate:
        opt = build_optimizer(
            model, name="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation=name
        )
        for p in model.parameters():
            init_adamw_state(opt, p)
        return EagerUpdate.of(opt, name, CUDA)

    fused, foreach = update("fused"), update("foreach")
    assert fused.scratch_bytes == 0
    assert foreach.scratch_bytes == 8_030_261_248 * 4
    assert fused.state_bytes == 2 * 8_030_261_248 * 4 + 291 * 512  # fused keeps 0-d steps on the device


def test_plan_with_the_cuda_choice_models_the_update_after_the_graph():
    """The planner with the CUDA choice (fused), on CPU shapes: the update costs no scratch, foreach costs
    every parameter's size; a shape small enough that the update, not the activations, is the peak."""
    small = ["--config", "llama3_debug", "--training.seq_len", "8", "--training.local_batch_size", "1"]
    plans = {}
    for name in IMPLEMENTATIONS:
        cfg, _ = load_config([*small, "--optimizer.implementation", name])
        plans[name] = plan_config(cfg, CPU)
    param_bytes = plans["fused"].num_params * 4
    for plan in plans.values():
        assert sum(plan.peak_by_category.values()) == plan.peak_bytes
    assert plans["fused"].optimizer == "fused"
    assert "AdamW" not in plans["fused"].peak_where  # no scratch: the graph, not the update, is the peak
    assert plans["foreach"].peak_where == "the eager AdamW update (foreach)"
    assert plans["foreach"].peak_by_category["optimizer_scratch"] == param_bytes
    single = plans["single_tensor"]
    assert single.peak_where == "the eager AdamW update (single_tensor)"
    assert plans["foreach"].peak_bytes - single.peak_bytes == param_bytes - single.peak_by_category["optimizer_scratch"]
    cfg, _ = load_config([*small, "--compile.trace_optimizer", "true"])
    assert plan_config(cfg, CPU).optimizer == "in graph"


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_trainer_estimate_equals_measured_cpu_peak_with_each_implementation(tmp_path, implementation):
    result, _ = train(tmp_path, "--optimizer.implementation", implementation, steps=2, base=TINY)
    for record in result.records:
        assert record["estimated_peak_bytes"] == record["peak_active_bytes"]


def test_the_traced_update_reads_the_lr_of_the_groups_a_resume_loaded():
    """Optimizer.load_state_dict replaces the group dicts; the traced AdamW must not keep reading the old ones."""
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, name="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    traced = GraphAdamW(optimizer)
    optimizer.load_state_dict(optimizer.state_dict())
    optimizer.param_groups[0]["lr"] = 0.5  # what the scheduler does to the new groups
    step_size = traced.host_scalars()[2].item()  # -(lr / bias correction 1) at step 1
    assert step_size == pytest.approx(-0.5 / (1 - 0.9))
