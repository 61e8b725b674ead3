"""The pass pipeline: registry and order, disable_passes validation, graph dumps, DCE keeping in-place
optimizer ops, no-op removal and remat preserving numerics bitwise, remat being final."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.fx.node import map_arg
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from graph_trainer.eager.step import EagerStep
from graph_trainer.errors import ConfigError
from graph_trainer.job_config.cli import load_config
from graph_trainer.optimizer.adamw import GraphAdamW, build_optimizer
from graph_trainer.passes import available_passes, build_pipeline, memory_policy_transform
from graph_trainer.passes.activation_checkpoint import tag_activation_checkpoint
from graph_trainer.passes.cleanup import dead_code_elimination, remove_noops
from graph_trainer.passes.op_patterns import parse_op_pattern
from graph_trainer.passes.remat import remat_graph, rematerialize
from graph_trainer.tracer import GraphStep, node_meta
from graph_trainer.tracer.capture import trace_step
from graph_trainer.tracer.graph_utils import graph_module, is_attention, is_mutating, node_flops, packet
from graph_trainer.tracer.memory_estimate import estimate_peak_memory
from models.llama3.model import ModelArgs, Transformer


def _cfg(*extra: str):
    cfg, _ = load_config(["--config", "llama3_debug.toml", *extra])
    return cfg


def _model_and_batch(dropout: float = 0.1):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, dropout=dropout))
    batch = {"input": torch.randint(0, 64, (2, 16)), "labels": torch.randint(0, 64, (2, 16))}
    return model, batch


def _run(gm, inputs):
    torch.manual_seed(1)
    with torch.no_grad():
        return [t.clone() for t in gm(*[t.clone() for t in inputs])]


def test_unknown_pass_in_disable_passes_lists_the_available_ones():
    with pytest.raises(ConfigError, match="unknown pass 'cse'.*dce, remove_noops"):
        build_pipeline(_cfg("--compile.disable_passes", "cse"), dump_dir=None)


@pytest.mark.parametrize("mode", ["selective", "full", "budget"])
@pytest.mark.parametrize("disabled", ["memory_policy", "remat"])
def test_disabling_the_memory_policy_while_a_mode_asks_for_it_is_a_config_error(mode, disabled):
    with pytest.raises(ConfigError, match=f"has '{disabled}', but activation_checkpoint.mode = '{mode}' needs it"):
        build_pipeline(_cfg("--activation_checkpoint.mode", mode, "--compile.disable_passes", disabled), dump_dir=None)
    build_pipeline(_cfg("--compile.disable_passes", disabled), dump_dir=None)  # mode none: nothing to disable


@pytest.mark.parametrize("old", ["activation_checkpoint", "memory_budget"])
def test_a_renamed_pass_name_says_its_new_name(old):
    with pytest.raises(ConfigError, match=f"pass '{old}' is now part of 'memory_policy'"):
        build_pipeline(_cfg("--compile.disable_passes", old), dump_dir=None)


@pytest.mark.parametrize("entry", ["aten.notanop", "aten.mm.nooverload", "layers.*::aten.bogus"])
def test_bad_override_pattern_is_a_config_error(entry):
    with pytest.raises(ConfigError, match="recompute_list"):
        build_pipeline(
            _cfg("--activation_checkpoint.mode", "selective", "--activation_checkpoint.recompute_list", entry),
            dump_dir=None,
        )


def test_override_pattern_matches_op_overload_and_module_glob():
    model, batch = _model_and_batch()
    gm = trace_step(model, batch).gm
    mms = [n for n in gm.graph.nodes if n.target == torch.ops.aten.mm.default and node_meta.is_forward(n)]
    attn = parse_op_pattern("layers.*.attention::aten.mm", "x")
    assert {node_meta.module_fqn(n).rsplit(".", 1)[0] for n in mms if attn.matches(n)} == {
        "layers.0.attention",
        "layers.1.attention",
    }
    assert all(parse_op_pattern("aten.mm.default", "x").matches(n) for n in mms)


def test_pipeline_runs_in_order_logs_and_dumps_each_pass(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="graph_trainer")
    model, batch = _model_and_batch()
    cfg = _cfg(
        "--compile.dump_graphs",
        "true",
        "--activation_checkpoint.mode",
        "full",
        "--compile.log_saved_activations",
        "true",
    )
    result = build_pipeline(cfg, dump_dir=tmp_path)(trace_step(model, batch))
    ran = [line.split(":")[0].removeprefix("pass ") for line in caplog.messages if line.startswith("pass ")]
    assert ran == ["dce", "remove_noops", "memory_policy", "remat"]
    assert [n for n in available_passes() if n in ran] == ran  # registry order
    dumped = sorted(p.name for p in (tmp_path / "trace_1").iterdir())
    assert dumped == [
        "00_traced.py",
        "01_after_dce.py",
        "02_after_remove_noops.py",
        "03_after_memory_policy.py",
        "04_after_remat.py",
        "saved_tensors.txt",
        "summary.txt",
    ]
    assert "_recomputed" in (tmp_path / "trace_1" / "04_after_remat.py").read_text()
    assert result.memory_estimate is not None and result.memory_estimate.peak_bytes > 0
    assert any(node_meta.is_rematerialized(n) for n in result.traced.gm.graph.nodes)
    assert any(line.startswith("saved activations:") and "per layer" in line for line in caplog.messages)

    caplog.clear()
    no_dce = _cfg("--compile.disable_passes", "dce,remove_noops")
    build_pipeline(no_dce, dump_dir=None)(trace_step(model, batch))
    assert not any(line.startswith("pass ") for line in caplog.messages)


def test_dce_keeps_in_place_optimizer_ops_and_numerics():
    model, batch = _model_and_batch(dropout=0.0)
    optimizer = GraphAdamW(build_optimizer(model, name="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    traced = trace_step(model, batch, optimizer=optimizer)
    gm = traced.gm
    inputs = [
        *model.parameters(),
        *model.buffers(),
        *batch.values(),
        *optimizer.state_tensors(),
        *optimizer.host_scalars(),
    ]
    before = sum(is_mutating(n) for n in gm.graph.nodes)
    assert before > 0
    expected = _run(gm, inputs)
    gm = remove_noops(dead_code_elimination(gm))
    assert sum(is_mutating(n) for n in gm.graph.nodes) == before
    assert all(torch.equal(a, b) for a, b in zip(expected, _run(gm, inputs), strict=True))


def test_remat_is_bitwise_and_final():
    model, batch = _model_and_batch()
    traced = trace_step(model, batch)
    inputs = [*model.parameters(), *model.buffers(), *batch.values()]
    expected = _run(traced.gm, inputs)
    cfg = _cfg("--activation_checkpoint.mode", "full")
    gm = rematerialize(
        tag_activation_checkpoint(remove_noops(dead_code_elimination(traced.gm)), cfg.activation_checkpoint)
    )
    copies = [n for n in gm.graph.nodes if node_meta.is_rematerialized(n)]
    assert copies and not any(node_meta.is_random(n) for n in copies)
    assert all(torch.equal(a, b) for a, b in zip(expected, _run(gm, inputs), strict=True))
    assert rematerialize(gm) is gm  # nothing left to decide


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_remat_in_place_makes_the_graph_remat_graph_copies(mode):
    """The pass rewrites its graph in place (no copy of it); the result is `remat_graph`'s copy, node for node:
    names (golden dry runs print them), ops, arguments, metadata, and the memory estimate."""
    model, batch = _model_and_batch()
    traced = trace_step(model, batch)
    ac = _cfg("--activation_checkpoint.mode", mode).activation_checkpoint
    gm = tag_activation_checkpoint(remove_noops(dead_code_elimination(traced.gm)), ac)
    copied = remat_graph(gm.graph)
    assert copied is not None

    def described(graph):
        return [
            (n.name, n.op, n.target, str(map_arg((n.args, n.kwargs), lambda a: a.name)), n.meta.get("custom"))
            for n in graph.nodes
        ]

    expected = described(copied)
    assert rematerialize(gm) is gm
    assert described(gm.graph) == expected
    assert any(name.endswith("_recomputed") for name, *_ in expected)
    categories = traced.layout.categories
    assert estimate_peak_memory(gm, input_categories=categories) == estimate_peak_memory(
        graph_module(gm, copied), input_categories=categories
    )


@pytest.mark.parametrize("mode", ["selective", "full", "budget"])
def test_memory_policy_transform_gives_a_users_step_the_policy_bitwise(mode):
    model, batch = _model_and_batch(dropout=0.0)
    eager_model = copy.deepcopy(model)
    step = GraphStep(model, max_norm=1.0, transform=memory_policy_transform(mode, memory_budget=0.9))
    loss, norm = step(batch)
    loss_e, norm_e = EagerStep(eager_model, max_norm=1.0)(batch)
    assert torch.equal(loss, loss_e) and torch.equal(norm, norm_e)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), eager_model.parameters(), strict=True))
    assert any(node_meta.is_rematerialized(n) for n in step.traced.gm.graph.nodes)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "sometimes"}, "activation_checkpoint.mode must be one of none|selective|full|budget"),
        ({"selective_ac_option": "half"}, "selective_ac_option must be 'op' or a positive int"),
        ({"mode": "budget", "memory_budget": 0}, "memory_budget must be > 0"),
    ],
)
def test_memory_policy_transform_refuses_bad_arguments_before_tracing(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        memory_policy_transform(**kwargs)


def test_node_flops_are_what_flop_counter_mode_counts():
    model, batch = _model_and_batch(dropout=0.0)
    gm = trace_step(model, batch).gm
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        gm(*model.parameters(), *model.buffers(), *batch.values())
    counted = sum(node_flops(n) for n in gm.graph.nodes if packet(n) in flop_registry)
    assert counted == counter.get_total_flops() > 0
    # CPU attention, which torch does not count, is counted with the formula of the same math on CUDA.
    attention = [n for n in gm.graph.nodes if is_attention(n.target)]
    assert attention and all(node_flops(n) > 0 for n in attention)


# --------------------------------------------------------------------------- the pass contract


def test_a_pass_whose_prerequisite_does_not_run_is_refused_by_name_before_tracing():
    """remat acts on recompute tags; with FSDP's gather policy disabled and no AC mode, nothing gives them."""
    cfg = _cfg("--parallelism.dp_shard", "2", "--compile.disable_passes", "fsdp_gather")
    with pytest.raises(ConfigError, match=r"pass 'remat' needs recompute tags.*fsdp_gather, memory_policy must run"):
        build_pipeline(cfg, dump_dir=None)
    with_gather = build_pipeline(_cfg("--parallelism.dp_shard", "2"), dump_dir=None)
    assert [p.name for p in with_gather.passes] == ["dce", "remove_noops", "fsdp_gather", "remat"]


def test_every_registered_pass_declares_its_contract():
    from graph_trainer.passes import REGISTRY
    from graph_trainer.passes.pipeline import check_needs

    check_needs(list(REGISTRY), list(REGISTRY))  # in registry order every need is given by an earlier pass
    for p in REGISTRY:
        assert p.preserves_numerics_bitwise in (True, False) and p.doc, p.name
        assert all(key.split(".")[0] in ("activation_checkpoint", "parallelism") for key in p.reads), p.name


def _pipeline_with(extra_pass):
    from graph_trainer.passes import PassConfig, Pipeline
    from graph_trainer.passes.pipeline import GraphPass

    cfg = _cfg()
    first = GraphPass("dce", lambda gm, ctx: dead_code_elimination(gm), True, lambda c: True, "dce")
    bad = GraphPass("bad_pass", extra_pass, True, lambda c: True, "breaks a rule")
    return Pipeline([first, bad], PassConfig(cfg.activation_checkpoint, cfg.parallelism))


def test_a_pass_that_leaves_an_invalid_graph_is_named_with_the_passes_before_it():
    from graph_trainer.passes.pipeline import PassError

    def dangling(gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        with gm.graph.inserting_before(next(iter(gm.graph.nodes))):  # a use before its definition
            gm.graph.call_function(torch.ops.aten.neg.default, (node,))
        return gm

    model, batch = _model_and_batch(dropout=0.0)
    with pytest.raises(PassError, match=r"pass 'bad_pass' left an invalid graph .*passes run before it: dce"):
        _pipeline_with(lambda gm, ctx: dangling(gm))(trace_step(model, batch))


def test_a_pass_that_writes_a_graph_input_is_refused():
    from graph_trainer.passes.pipeline import PassError

    def write_a_parameter(gm):
        param = next(n for n in gm.graph.nodes if n.op == "placeholder")
        out = gm.graph.output_node()
        with gm.graph.inserting_before(out):
            gm.graph.call_function(torch.ops.aten.zero_.default, (param,))
        gm.recompile()
        return gm

    model, batch = _model_and_batch(dropout=0.0)
    with pytest.raises(PassError, match=r"pass 'bad_pass' writes graph inputs the traced step did not write"):
        _pipeline_with(lambda gm, ctx: write_a_parameter(gm))(trace_step(model, batch))


def test_collective_ops_are_recognised_as_op_objects():
    from graph_trainer.tracer import graph_utils

    c10d = torch.ops._c10d_functional
    assert c10d.all_gather_into_tensor_out in graph_utils.ALL_GATHER_OPS
    assert c10d.reduce_scatter_tensor in graph_utils.REDUCE_SCATTER_OPS
    assert c10d.wait_tensor in graph_utils.WAIT_OPS and c10d.wait_tensor not in graph_utils.COLLECTIVE_OPS
