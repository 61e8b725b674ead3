"""The tracer API on a Hugging Face model nobody here wrote: a tiny random Llama built from a config.

transformers is not a dependency of graph_trainer, only of its `test` extra: these tests skip where it is
not installed, and fail under CI=true (tests/extras.py). Nothing is downloaded.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from graph_trainer.eager.step import EagerStep
from graph_trainer.passes import memory_policy_transform
from graph_trainer.tracer import GraphStep, TraceError, trace_step
from tests.extras import import_extra

transformers = import_extra("transformers")


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def tiny_hf_llama() -> nn.Module:
    # Eager attention: with "sdpa", transformers passes is_causal in eager but builds a mask while
    # tracing, a different kernel call (docs/tracer_api.md says so).
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def hf_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss


def hf_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_hf_gradient_checkpointing_is_refused_up_front_with_the_memory_policy_as_the_fix(enable):
    model = tiny_hf_llama()
    if not hasattr(model, enable):
        pytest.skip(f"transformers {transformers.__version__} has no {enable}()")
    getattr(model, enable)()
    with pytest.raises(TraceError) as info:
        trace_step(model, hf_batch(), loss_fn=hf_loss)
    msg = str(info.value)
    assert "gradient checkpointing on" in msg and "FakeTensor" not in msg
    assert "model.gradient_checkpointing_disable()" in msg and "memory_policy_transform('full')" in msg


def test_a_model_calling_torch_utils_checkpoint_itself_gets_the_same_advice():
    class SelfCheckpointing(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.outer(torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False))

    with pytest.raises(TraceError, match="the model calls torch.utils.checkpoint.*memory_policy_transform"):
        trace_step(SelfCheckpointing(), {"x": torch.randn(2, 4)}, loss_fn=lambda m, b: m(b["x"]).square().mean())


@pytest.mark.parametrize("mode", ["none", "full"])
def test_hf_model_with_the_memory_policy_instead_of_its_own_checkpointing_is_bitwise_equal_to_eager(mode, caplog):
    model = tiny_hf_llama()
    model.gradient_checkpointing_enable()
    model.gradient_checkpointing_disable()
    eager_model = copy.deepcopy(model)
    loss_e, norm_e = EagerStep(eager_model, loss_fn=hf_loss, max_norm=1.0)(hf_batch())
    step = GraphStep(
        model, loss_fn=hf_loss, max_norm=1.0, layers="model.layers", transform=memory_policy_transform(mode)
    )
    with caplog.at_level("WARNING"):
        loss_t, norm_t = step(hf_batch())
    assert "recomputes nothing" not in caplog.text and "took" not in caplog.text
    assert torch.equal(loss_e, loss_t) and torch.equal(norm_e, norm_t)
    for (name, pe), pt in zip(eager_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(pe.grad, pt.grad), name
