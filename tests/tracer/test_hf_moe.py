"""Mixtures of experts nobody here wrote, through the public tracer API: a tiny random Hugging Face Qwen3-MoE with
each of transformers' expert implementations (grouped_mm, batched_mm, the per-expert loop) and dtypes.

Nothing is downloaded; transformers is a test extra (a missing one skips here and fails under CI=true).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

from graph_trainer.eager.step import EagerStep
from graph_trainer.tracer import GraphStep, TraceError
from tests.extras import import_extra

transformers = import_extra("transformers")


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def tiny_qwen3_moe(experts: str, dtype: torch.dtype) -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attn_implementation="eager",
        experts_implementation=experts,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(dtype).train()


def hf_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss


def hf_batch() -> dict[str, torch.Tensor]:
    # 4 x 32 tokens top-2 over 4 experts: every expert's weight is gathered for many rows (repeated indices).
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _traced_equals_eager(experts: str, dtype: torch.dtype) -> GraphStep:
    eager_model = tiny_qwen3_moe(experts, dtype)
    graph_model = copy.deepcopy(eager_model)
    a = EagerStep(eager_model, loss_fn=hf_loss)(hf_batch())
    step = GraphStep(graph_model, loss_fn=hf_loss)
    b = step(hf_batch())
    assert torch.equal(a.loss, b.loss) and torch.equal(a.grad_norm, b.grad_norm)
    for (name, p), q in zip(eager_model.named_parameters(), graph_model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    return step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mm_experts_trace_bitwise_in_bf16_and_fp32(dtype, deterministic):
    # fp32 traces through graph_trainer.tracer.fake_rules (torch's own fake kernel accepts bf16 only).
    step = _traced_equals_eager("grouped_mm", dtype)
    assert any(n.target is torch.ops.aten._grouped_mm.default for n in step.traced.gm.graph.nodes)


def test_batched_mm_experts_trace_bitwise_with_deterministic_accumulation(deterministic):
    _traced_equals_eager("batched_mm", torch.float32)


def test_batched_mm_nondeterministic_accumulation_is_named_not_silent(caplog):
    """The ~1e-10 gradient differences of fp32 batched_mm come from aten.index_put(accumulate=True), the backward
    of `gate_up_proj[expert_ids]`: without deterministic algorithms two *eager* runs already differ. The trace
    says so, naming the op and module, and the way out."""
    model = tiny_qwen3_moe("batched_mm", torch.float32)
    with caplog.at_level(logging.WARNING, logger="graph_trainer"):
        GraphStep(model, loss_fn=hf_loss).ensure_traced(hf_batch())
    warning = next(r.getMessage() for r in caplog.records if "index_put" in r.getMessage())
    assert ".mlp.experts'" in warning and "torch.use_deterministic_algorithms(True)" in warning


def test_per_expert_loop_is_refused_naming_module_line_and_op():
    model = tiny_qwen3_moe("eager", torch.float32)
    with pytest.raises(TraceError) as e:
        GraphStep(model, loss_fn=hf_loss)(hf_batch())
    message = str(e.value)
    assert "\n" not in message
    assert "module 'model.layers.0.mlp.experts'" in message and "aten.nonzero" in message
    assert "modeling_qwen3_moe.py:" in message and ".nonzero()" in message
