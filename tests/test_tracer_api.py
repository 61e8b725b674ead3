"""The tracer API's errors speak in API terms; the CLI keeps its own advice."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
import torch.nn as nn

from graph_trainer.tracer.capture import TraceError, trace_step
from graph_trainer.tracer.executor import GraphStep
from graph_trainer.builder import cli_trace_errors


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
    assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads))
    # The constant is specialized on: a new value retraces, with the reason.
    step(Encoding({"input_ids": ids, "labels": ids.roll(1, 1), "scale": 4}))
    assert step.stats.count == 2 and "scale" in step.stats.reasons[0]


def test_batch_leaf_that_is_neither_tensor_nor_python_scalar_is_refused_clearly():
    model = TinyLM()
    ids = torch.randint(0, 16, (2, 5))
    with pytest.raises(TraceError, match=r"batch leaf \['scale'\] is an? object"):
        trace_step(model, {"input_ids": ids, "labels": ids, "scale": object()}, loss_fn=_scaled_loss)
