"""The traced step never runs stale: a Python value the trace baked in that changes retraces (with the reason
naming it) or stops, and the step stays bitwise equal to eager after the change; nothing changed, no retrace."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

from graph_trainer.eager.step import EagerStep
from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from graph_trainer.tracer.eval_step import GraphEvalStep
from graph_trainer.tracer.executor import GraphStep
from graph_trainer.trainer import Trainer
from tests.tiny import TINY


class Block(nn.Module):
    """Reads a float, an int and a bool of its own in forward, and holds a dropout that reads `training`."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.25)
        self.temperature = 1.0  # float
        self.shift = 1  # int: an op argument
        self.gated = True  # bool: Python control flow
        self.unused = 3.0  # never read by forward: not guarded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.roll(self.lin(x) / self.temperature, self.shift, dims=-1)
        if self.gated:
            y = torch.sigmoid(y) * y
        return x + self.drop(y)


class Stack(nn.Module):
    def __init__(self, dim: int = 8, n_layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"]).square().mean()


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))}


def _steps() -> tuple[Stack, EagerStep, Stack, GraphStep]:
    torch.manual_seed(0)
    model_e = Stack().eval()  # dropout off until a test turns it on
    model_t = copy.deepcopy(model_e)
    return model_e, EagerStep(model_e, loss_fn=_loss), model_t, GraphStep(model_t, loss_fn=_loss)


def _assert_step_bitwise(model_e: nn.Module, eager: EagerStep, model_t: nn.Module, graph: GraphStep, seed: int):
    torch.manual_seed(seed)  # the same dropout masks for both
    loss_e = eager(_batch(seed)).loss
    torch.manual_seed(seed)
    loss_t = graph(_batch(seed)).loss
    assert torch.equal(loss_e, loss_t), (loss_e.item(), loss_t.item())
    for (name, pe), pt in zip(model_e.named_parameters(), model_t.parameters(), strict=True):
        assert torch.equal(pe.grad, pt.grad), name


CHANGES = {
    "float": (lambda m: setattr(m.blocks[1], "temperature", 0.5), "blocks.1.temperature 1.0 -> 0.5"),
    "int": (lambda m: setattr(m.blocks[1], "shift", 3), "blocks.1.shift 1 -> 3"),
    "bool": (lambda m: setattr(m.blocks[0], "gated", False), "blocks.0.gated True -> False"),
    "train()": (lambda m: m.train(), "blocks.0.drop.training False -> True"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_attribute_retraces_naming_it_and_stays_bitwise_equal_to_eager(change, caplog):
    caplog.set_level(logging.INFO, logger="graph_trainer")
    model_e, eager, model_t, graph = _steps()
    _assert_step_bitwise(model_e, eager, model_t, graph, seed=0)
    apply, reason = CHANGES[change]
    apply(model_e), apply(model_t)
    _assert_step_bitwise(model_e, eager, model_t, graph, seed=1)
    assert graph.stats.count == 2 and len(graph.stats.reasons) == 1
    assert reason in graph.stats.reasons[0]
    assert any(f"retracing the step: module attribute {reason}" in m for m in caplog.messages)


def test_eval_after_train_retraces_and_dropout_stops_as_in_eager():
    model_e, eager, model_t, graph = _steps()
    model_e.train(), model_t.train()
    _assert_step_bitwise(model_e, eager, model_t, graph, seed=0)
    model_e.eval(), model_t.eval()
    _assert_step_bitwise(model_e, eager, model_t, graph, seed=1)
    # Every dropout's flag changed: the reason names the first ones and counts the rest.
    assert graph.stats.count == 2 and "blocks.0.drop.training True -> False" in graph.stats.reasons[0]


def test_nothing_changed_no_retrace_and_only_what_forward_read_is_guarded():
    model_e, eager, model_t, graph = _steps()
    for seed in range(3):
        _assert_step_bitwise(model_e, eager, model_t, graph, seed)
    model_t.blocks[0].unused = -1.0  # forward never reads it: the graph does not depend on it
    graph(_batch())
    assert graph.stats.count == 1 and not graph.stats.reasons
    guarded = set(zip(graph.traced.guard.fqns, graph.traced.guard.names, strict=True))
    assert ("blocks.0", "temperature") in guarded and ("blocks.0.drop", "training") in guarded
    assert ("blocks.0", "unused") not in guarded and ("", "training") not in guarded  # Stack.forward reads no flag


def test_a_changed_attribute_with_on_shape_change_error_stops_in_one_line():
    torch.manual_seed(0)
    model = Stack().eval()
    graph = GraphStep(model, loss_fn=_loss, on_shape_change="error")
    graph(_batch())
    model.blocks[1].temperature = 2.0
    with pytest.raises(UserError, match=r"blocks\.1\.temperature 1\.0 -> 2\.0.*compile\.on_shape_change") as info:
        graph(_batch())
    assert "\n" not in str(info.value)


def test_int_to_float_of_equal_value_is_a_change():
    """1 == 1.0, but an int and a float trace differently (type promotion), so the guard compares types too."""
    torch.manual_seed(0)
    model = Stack().eval()
    graph = GraphStep(model, loss_fn=_loss)
    graph(_batch())
    model.blocks[0].temperature = 1  # was 1.0
    graph(_batch())
    assert graph.stats.count == 2 and "blocks.0.temperature 1.0 -> 1" in graph.stats.reasons[0]


def test_autocast_switched_on_retraces_and_matches_eager_under_it():
    model_e, eager, model_t, graph = _steps()
    _assert_step_bitwise(model_e, eager, model_t, graph, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_step_bitwise(model_e, eager, model_t, graph, seed=1)
    assert graph.stats.count == 2 and "autocast('cpu') enabled False -> True" in graph.stats.reasons[0]


class Counter(nn.Module):
    """Writes the Python state it reads on every forward: the graph bakes one value."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


def test_a_step_that_changes_what_it_reads_is_warned_about_and_follows_eager(caplog):
    torch.manual_seed(0)
    model_e = Counter()
    model_t = copy.deepcopy(model_e)
    eager, graph = EagerStep(model_e, loss_fn=_loss), GraphStep(model_t, loss_fn=_loss)
    batch = {"x": torch.randn(2, 4)}
    for _ in range(3):
        assert torch.equal(eager(batch).loss, graph(batch).loss)
    assert graph.stats.count == 3
    assert graph.stats.reasons == ["module attribute calls 0 -> 1", "module attribute calls 1 -> 2"]
    warnings = [m for m in caplog.messages if "changes state it reads" in m]
    assert len(warnings) == 1 and "(module attribute calls 0 -> 1)" in warnings[0]  # once, not every step


def test_the_trainer_counts_and_logs_a_retrace_for_a_changed_attribute(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="graph_trainer")
    cfg, _ = load_config(["--config", "llama3_debug", *TINY, "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(cfg)
    data = iter(trainer.dataloader)
    # The preflight's trace (on the meta model) is reused: its guard must watch the live model's modules.
    assert trainer.train_step(dict(next(data)))["trace_count"] == 1
    trainer.model.norm.eps = 1e-3
    record = trainer.train_step(dict(next(data)))
    assert record["trace_count"] == 2
    assert trainer.step_fn.report().retrace_reasons == ["module attribute norm.eps 1e-05 -> 0.001"]
    assert any("retracing the step: module attribute norm.eps" in m for m in caplog.messages)


def test_the_evaluation_step_follows_a_changed_attribute_but_not_the_training_flag():
    """The evaluation graph is in eval mode whatever the live flags, so train()/eval() must not retrace it."""
    torch.manual_seed(0)
    model = Stack().train()
    evaluate = GraphEvalStep(model, loss_fn=_loss)
    evaluate(_batch())
    model.eval()
    evaluate(_batch())
    assert evaluate.trace_count == 1
    model.blocks[1].temperature = 0.5
    with torch.no_grad():
        expected = _loss(model, _batch())
    assert torch.equal(evaluate(_batch()), expected) and evaluate.trace_count == 2


# --------------------------------------------------------------------------- the model's tensors


def test_a_state_dict_loaded_with_assign_is_what_the_step_trains(caplog):
    """`load_state_dict(assign=True)` (how pretrained weights are often loaded) replaces every parameter and buffer
    object: the step reads the new ones, bitwise as eager does, and their gradients land on them. It once kept
    training the tensors it was built with, silently."""
    caplog.set_level(logging.INFO, logger="graph_trainer")
    model_e, eager, model_t, graph = _steps()
    _assert_step_bitwise(model_e, eager, model_t, graph, seed=0)
    new = {k: v * 2 for k, v in model_t.state_dict().items()}
    model_e.load_state_dict(new, assign=True), model_t.load_state_dict(new, assign=True)
    _assert_step_bitwise(model_e, eager, model_t, graph, seed=1)
    assert graph.stats.count == 1  # the same shapes and dtypes: the graph still fits, only its inputs moved
    assert all(p.grad is not None for p in model_t.parameters())
    assert any("the model's tensors were replaced since the last step" in m for m in caplog.messages)


def test_a_cast_model_retraces_naming_the_tensors_and_matches_eager():
    """`model.double()` swaps each parameter's data in place (the same objects): the graph was traced for
    float32 inputs, so it no longer fits, and the reason names the first tensors and counts the rest."""
    from graph_trainer.tracer.guards import tensor_meta

    model_e, eager, model_t, graph = _steps()
    _assert_step_bitwise(model_e, eager, model_t, graph, seed=0)
    before = graph.traced
    model_e.double(), model_t.double()
    live = tensor_meta((*model_t.named_parameters(), *model_t.named_buffers()))
    why = before.guard.stale(before.layout.grad_names, live)
    assert why == "tensor blocks.0.lin.weight float32 [8, 8] -> float64 [8, 8]; blocks.0.lin.bias float32 [8] -> " \
        "float64 [8]; blocks.1.lin.weight float32 [8, 8] -> float64 [8, 8] and 1 more"  # fmt: skip
    double = {"x": _batch(1)["x"].double()}
    loss_e, loss_t = eager(double).loss, graph(double).loss
    assert loss_t.dtype == torch.float64 and torch.equal(loss_e, loss_t) and graph.stats.count == 2


def test_a_parameter_replaced_under_its_optimizer_stops_in_one_line():
    """The optimizer holds the old tensor: stepping it while the model reads the new one would train nothing the
    model uses. Refused, with the order that works."""
    torch.manual_seed(0)
    model = Stack().eval()
    graph = GraphStep(model, loss_fn=_loss, eager_optimizer=torch.optim.AdamW(model.parameters()))
    graph(_batch())
    model.blocks[0].lin.weight = nn.Parameter(model.blocks[0].lin.weight.detach().clone())
    with pytest.raises(UserError, match=r"parameter blocks\.0\.lin\.weight was replaced .* build the optimizer") as e:
        graph(_batch())
    assert "\n" not in str(e.value)
