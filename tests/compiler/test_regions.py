"""The step graph cut into regions (`graph_trainer.compiler.regions`, used by `compile.regional`):
run in order they compute the graph bitwise, identical layers make identical regions whatever the
depth, and the driver lets go of each value before the region that reads it last."""

from __future__ import annotations

import tempfile

import pytest
import torch

from graph_trainer.compiler.inductor import _functional
from graph_trainer.compiler.regions import RegionalStep, dedup_key, region_labels, split_into_regions
from graph_trainer.job_config.cli import load_config
from graph_trainer.tracer import node_meta
from graph_trainer.trainer import Trainer

TINY = [
    "--model.dim",
    "64",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
]


def traced_tiny(layers: int, ac: str = "selective", optimizer: bool = True):
    cfg, _ = load_config(
        [
            "--config",
            "llama3_debug",
            *TINY,
            "--model.n_layers",
            str(layers),
            "--activation_checkpoint.mode",
            ac,
            "--compile.trace_optimizer",
            str(optimizer).lower(),
            "--job.dump_folder",
            tempfile.mkdtemp(prefix="gt_regions_"),
        ]
    )
    t = Trainer(cfg)
    batch = dict(next(iter(t.dataloader)))
    return t.step_fn.ensure_traced(batch), t.step_fn.flat_inputs(batch)


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("optimizer", [True, False], ids=["opt-in-graph", "opt-outside"])
def test_regions_run_in_order_compute_the_graph_bitwise(ac, optimizer):
    traced, inputs = traced_tiny(3, ac, optimizer)
    plan = split_into_regions(traced.gm)
    whole_in, regions_in = [x.clone() for x in inputs], [x.clone() for x in inputs]
    with torch.no_grad():
        expected = traced.gm(*whole_in)
        got = RegionalStep(plan, [lambda args, gm=r.gm: gm(*args) for r in plan.regions])(regions_in)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    # The in-place effects (AdamW on parameters and state) are the graph's too.
    assert all(torch.equal(a, b) for a, b in zip(whole_in, regions_in, strict=True))
    if optimizer:
        assert any(not torch.equal(a, b) for a, b in zip(inputs, regions_in, strict=True)), "nothing was updated"

    def ops(gm):
        return sum(n.op == "call_function" for n in gm.graph.nodes)

    assert sum(ops(r.gm) for r in plan.regions) == ops(traced.gm)


def _distinct(gm: torch.fx.GraphModule) -> tuple[int, dict[str, list]]:
    plan = split_into_regions(gm)
    keys = {}
    for region in plan.regions:
        functional, fakes, _ = _functional(region.gm)
        keys.setdefault(region.label, []).append(dedup_key(functional, fakes))
    return len({k for ks in keys.values() for k in ks}), {label: ks for label, ks in keys.items()}


@pytest.mark.integration  # traces steps of several depths
def test_identical_layers_give_identical_regions_so_distinct_regions_do_not_grow_with_depth():
    shallow, _ = traced_tiny(3)
    deep, _ = traced_tiny(4)  # two middle layers: the fewest that can share a compile
    distinct_shallow, by_label = _distinct(shallow.gm)
    distinct_deep, by_label_deep = _distinct(deep.gm)
    assert distinct_deep == distinct_shallow
    assert len(split_into_regions(deep.gm).regions) > len(split_into_regions(shallow.gm).regions)
    # The middle layers' forward and backward are one compile each.
    assert by_label_deep["layer 1 forward"] == by_label_deep["layer 2 forward"]
    assert by_label_deep["layer 1 backward"] == by_label_deep["layer 2 backward"]
    assert by_label["layer 1 forward"] == by_label_deep["layer 2 forward"]


def test_each_value_is_dropped_once_at_its_last_reader_and_outputs_are_kept():
    traced, _ = traced_tiny(3, "none")
    plan = split_into_regions(traced.gm)
    results = {ref for kind, ref in plan.result if kind == "slot"}
    made = {s for r in plan.regions for s in r.outputs}
    dropped = [s for r in plan.regions for s in r.drops]
    assert len(dropped) == len(set(dropped))
    assert not set(dropped) & results
    assert all(s >= plan.n_inputs for s in dropped), "a graph input is the caller's to free"
    for i, region in enumerate(plan.regions):
        later_reads = {s for r in plan.regions[i + 1 :] for s in r.inputs}
        assert not set(region.drops) & later_reads
        assert set(region.drops) <= set(region.inputs)
    # Every value handed between regions is either returned or dropped: none lingers to the end.
    assert made - results == set(dropped) - set(plan.constants)


def test_the_loss_and_its_backward_share_a_region_outside_the_layers():
    traced, _ = traced_tiny(2, "none")
    labels = region_labels(traced.gm)
    loss_ops = [n for n in traced.gm.graph.nodes if n.op == "call_function" and "log_softmax" in str(n.target)]
    assert {n.target.__name__ for n in loss_ops} >= {"_log_softmax.default", "_log_softmax_backward_data.default"}
    assert {labels[n] for n in loss_ops} == {(None, None)}
    plan = split_into_regions(traced.gm)
    assert [r.label for r in plan.regions if any("log_softmax" in str(n.target) for n in r.gm.graph.nodes)] == [
        "outside the layers"
    ]


def test_optimizer_ops_carry_the_layer_of_their_parameter():
    traced, _ = traced_tiny(2)
    update = [n for n in traced.gm.graph.nodes if n.op == "call_function" and node_meta.phase(n) == "optimizer"]
    tagged = [n for n in update if node_meta.layer_id(n) is not None]
    assert {node_meta.layer_id(n) for n in tagged} == {0, 1}
    for n in tagged:  # e.g. layers.1.attention.wq: the module of the parameter the op updates
        assert node_meta.module_fqn(n).startswith(f"layers.{node_meta.layer_id(n)}.")
    # What mixes parameters (the global norm and the clip factor) belongs to no layer.
    untagged = {str(n.target) for n in update if n not in tagged and not node_meta.module_fqn(n)}
    assert "aten.stack.default" in untagged and "aten.clamp.default" in untagged
