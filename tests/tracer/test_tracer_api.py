"""The tracer API's errors speak in API terms; the CLI keeps its own advice."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
import torch.nn as nn

from graph_trainer.builder import cli_trace_errors
from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import ActivationCheckpointConfig
from graph_trainer.optimizer.adamw import GraphAdamW
from graph_trainer.passes.activation_checkpoint import tag_activation_checkpoint
from graph_trainer.passes.remat import rematerialize
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TraceError, trace_step
from graph_trainer.tracer.executor import GraphStep
from graph_trainer.tracer.memory_estimate import estimate_peak_memory
from tests.tracer.test_tracer import (
    assert_bitwise,
    eager_and_graph_adamw,
    eager_and_traced,  # noqa: F401
    make_batch,
    tiny_llama,
)


class ReadsAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent control flow: cannot be traced on fake tensors
            return y
        return -y


def _loss(model, batch):
    return model(batch["x"]).square().mean()


def test_api_trace_error_names_an_api_fix_not_a_cli_flag():
    with pytest.raises(TraceError) as info:
        trace_step(ReadsAValue(), {"x": torch.randn(2, 4)}, loss_fn=_loss)
    msg = str(info.value)
    assert "graph_trainer.eager.EagerStep" in msg
    assert "--compile.mode" not in msg


def test_cli_keeps_its_compile_mode_advice():
    with pytest.raises(TraceError) as info, cli_trace_errors():
        trace_step(ReadsAValue(), {"x": torch.randn(2, 4)}, loss_fn=_loss)
    msg = str(info.value)
    assert msg.endswith("run with --compile.mode eager")
    assert "EagerStep" not in msg


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, ids):
        return self.out(self.emb(ids))


class Encoding(Mapping):
    """A Mapping that is not a dict, as a tokenizer's BatchEncoding is."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def _scaled_loss(model, batch):
    logits = model(batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()) * batch["scale"]


def test_mapping_batch_with_python_constants_traces_and_matches_eager():
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, 16, (2, 5))
    batch = Encoding({"input_ids": ids, "labels": ids.roll(1, 1), "scale": 3})
    step = GraphStep(model, loss_fn=_scaled_loss)
    loss, _ = step(batch)
    grads = [p.grad.clone() for p in model.parameters()]
    eager_loss = _scaled_loss(model, batch)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    assert torch.equal(loss, eager_loss.detach())
    assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads, strict=True))
    # The constant is specialized on: a new value retraces, with the reason.
    step(Encoding({"input_ids": ids, "labels": ids.roll(1, 1), "scale": 4}))
    assert step.stats.count == 2 and "scale" in step.stats.reasons[0]


def test_batch_leaf_that_is_neither_tensor_nor_python_scalar_is_refused_clearly():
    model = TinyLM()
    ids = torch.randint(0, 16, (2, 5))
    with pytest.raises(TraceError, match=r"batch leaf \['scale'\] is an? object"):
        trace_step(model, {"input_ids": ids, "labels": ids, "scale": object()}, loss_fn=_scaled_loss)


# ----------------------------------------------------------------------------- frozen parameters


def _partly_frozen_llama():
    model = tiny_llama()
    model.tok_embeddings.weight.requires_grad_(False)
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    return model


def test_frozen_parameters_get_no_gradient_and_the_rest_is_bitwise_equal_to_eager():
    model = _partly_frozen_llama()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    eager, traced = eager_and_traced(model, make_batch(96))
    grads_e, grads_t = eager[2], traced[2]
    assert all(g is None for g, (_, p) in zip(grads_t, model.named_parameters(), strict=True) if not p.requires_grad)
    assert [g is None for g in grads_e] == [g is None for g in grads_t]
    assert_bitwise(
        (eager[0], eager[1], [g for g in grads_e if g is not None]),
        (traced[0], traced[1], [g for g in grads_t if g is not None]),
    )
    traced_step = trace_step(model, make_batch(96), max_norm=1.0)
    assert set(traced_step.layout.param_names) - set(traced_step.layout.grad_names) == set(frozen)
    assert len(traced_step.gm.graph.output_node().args[0]) == 2 + len(traced_step.layout.grad_names)


def test_optimizer_over_trainable_parameters_in_graph_matches_torch_adamw_and_leaves_frozen_alone():
    model_e, model_t = _partly_frozen_llama(), _partly_frozen_llama()
    frozen_before = {n: p.clone() for n, p in model_t.named_parameters() if not p.requires_grad}
    (opt_e, eager), (_, graph) = eager_and_graph_adamw(model_e, model_t)
    for i in range(3):
        batch = make_batch(96, seed=i)
        loss_e, _ = eager(batch)
        opt_e.step()
        loss_t, _ = graph(batch)
        assert torch.equal(loss_e, loss_t), f"step {i}"
    assert graph.stats.count == 1
    for (name, pe), pt in zip(model_e.named_parameters(), model_t.parameters(), strict=True):
        assert torch.equal(pe, pt), name
        assert (pt.grad is None) == (name in frozen_before), name
    for name, before in frozen_before.items():
        assert torch.equal(dict(model_t.named_parameters())[name], before), name


def test_optimizer_over_all_parameters_of_a_partly_frozen_model_is_refused():
    model = _partly_frozen_llama()
    opt = GraphAdamW(torch.optim.AdamW(model.parameters()))
    with pytest.raises(TraceError, match="exactly the model's trainable parameters"):
        trace_step(model, make_batch(96), optimizer=opt)


def test_unfreezing_a_parameter_retraces_with_the_reason():
    model = _partly_frozen_llama()
    step = GraphStep(model)
    step(make_batch(96))
    model.tok_embeddings.weight.requires_grad_(True)
    step(make_batch(96))
    assert step.stats.count == 2 and "requires_grad" in step.stats.reasons[0]
    assert model.tok_embeddings.weight.grad is not None


def test_a_model_with_nothing_to_train_is_refused():
    model = TinyLM().requires_grad_(False)
    ids = torch.randint(0, 16, (2, 5))
    with pytest.raises(TraceError, match="no parameter of the model requires grad"):
        trace_step(model, {"input_ids": ids, "labels": ids, "scale": 1}, loss_fn=_scaled_loss)


# ----------------------------------------------------------------------------- which modules are the layers


class WrappedLlama(nn.Module):
    """A wrapper that registers its own stack of modules before the real model's layers."""

    def __init__(self):
        super().__init__()
        self.adapters = nn.ModuleList(nn.Linear(96, 96) for _ in range(2))
        self.model = tiny_llama()

    def forward(self, ids):
        x = self.model(ids)
        for adapter in self.adapters:
            x = x + adapter(x)
        return x


def _saved_bytes(model: nn.Module, mode: str, **kw) -> int:
    traced = trace_step(model, make_batch(96), **kw)
    gm = traced.gm
    if mode != "none":
        gm = rematerialize(
            tag_activation_checkpoint(
                gm, ActivationCheckpointConfig(mode=mode), input_categories=traced.layout.categories
            )
        )
    return estimate_peak_memory(gm, input_categories=traced.layout.categories).saved_bytes


def _layer_tags(traced) -> list[tuple[int, str]]:
    """(layer id, module FQN) of every forward node inside a layer."""
    return [
        (node_meta.layer_id(n), node_meta.module_fqn(n))
        for n in traced.gm.graph.nodes
        if node_meta.is_forward(n) and node_meta.layer_id(n) is not None
    ]


def test_a_wrappers_own_module_list_is_not_taken_for_the_layers_and_the_guess_is_flagged(caplog):
    model = WrappedLlama()
    with caplog.at_level("WARNING"):
        traced = trace_step(model, make_batch(96))
    tags = _layer_tags(traced)
    assert {i for i, _ in tags} == {0, 1} and all(fqn.startswith("model.layers.") for _, fqn in tags)
    assert "took 'model.layers' as the model's transformer layers, but ['adapters']" in caplog.text
    # Full AC on the guessed layers saves far less than no AC.
    assert _saved_bytes(model, "full") < 0.5 * _saved_bytes(model, "none")


def test_naming_the_layer_container_is_obeyed_without_a_warning(caplog):
    model = WrappedLlama()
    with caplog.at_level("WARNING"):
        traced = trace_step(model, make_batch(96), layers="adapters")
        step = GraphStep(model, layers="model.layers")
        step(make_batch(96))
    assert "took" not in caplog.text
    tags = _layer_tags(traced)
    assert {i for i, _ in tags} == {0, 1} and all(fqn.startswith("adapters.") for _, fqn in tags)
    tags = _layer_tags(step.traced)
    assert {i for i, _ in tags} == {0, 1} and all(fqn.startswith("model.layers.") for _, fqn in tags)


def test_naming_a_missing_layer_container_is_a_user_error_with_a_suggestion():
    with pytest.raises(
        UserError,
        match=r"layers='model.layer': the model has no submodule .*did you mean "
        r"'model.layers'",
    ):
        trace_step(WrappedLlama(), make_batch(96), layers="model.layer")


def test_an_ac_plan_that_recomputes_nothing_is_warned_about(caplog):
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, 5))
    batch = {"input_ids": ids, "labels": ids, "scale": 1}
    traced = trace_step(TinyLM(), batch, loss_fn=_scaled_loss)  # no stack of blocks at all
    with caplog.at_level("WARNING"):
        tag_activation_checkpoint(
            traced.gm, ActivationCheckpointConfig(mode="full"), input_categories=traced.layout.categories
        )
    assert "activation_checkpoint.mode = 'full' recomputes nothing" in caplog.text
    assert "no transformer layers were found" in caplog.text
    # The wrapper's adapters as the layers: their matmuls would be recomputed, but the views of
    # their outputs at the layer boundary keep the same storage saved, so nothing is freed.
    caplog.clear()
    model = WrappedLlama()
    with caplog.at_level("WARNING"):
        assert _saved_bytes(model, "full", layers="adapters") == _saved_bytes(model, "none")
    assert "every tensor made in the layers (8 ops) stays saved" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        _saved_bytes(tiny_llama(), "full")
        _saved_bytes(tiny_llama(), "selective")
    assert "recomputes nothing" not in caplog.text
