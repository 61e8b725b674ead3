"""The whole-step tracer: bitwise equal to eager, annotated, traced once, loud when it cannot trace."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graph_trainer.eager.step import EagerStep
from graph_trainer.errors import UserError
from graph_trainer.job_config.model_args import build_model_args
from graph_trainer.loss import IGNORE_INDEX
from graph_trainer.observability.memory import LiveTensorTracker
from graph_trainer.optimizer.adamw import GraphAdamW
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import TraceError, trace_step
from graph_trainer.tracer.executor import GraphStep
from models.llama3 import Transformer


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def tiny_llama(**overrides) -> Transformer:
    args = build_model_args(
        "llama3",
        "debugmodel",
        {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96, "multiple_of": 32, **overrides},
    )
    torch.manual_seed(0)
    return Transformer(args)


def make_batch(vocab: int, batch: int = 2, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"input": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


# --------------------------------------------------------------------------------------------
# An independently structured Llama-style model, written here so the tracer is not tuned to ours:
# fused QKV projection, complex-valued rotary embeddings, tied input/output embedding, a
# registered (persistent) buffer, blocks held in `h`.


class ComplexRope(nn.Module):
    def __init__(self, head_dim: int, max_len: int):
        super().__init__()
        freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_len).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, H, D]
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out = torch.view_as_real(xc * self.freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1))
        return out.flatten(3).type_as(x)


class FusedBlock(nn.Module):
    def __init__(self, dim: int, heads: int, max_len: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.rope = ComplexRope(dim // heads, max_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads) for t in (q, k, v))
        q, k = self.rope(q), self.rope(k)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class IndependentLM(nn.Module):
    def __init__(self, vocab: int = 80, dim: int = 32, heads: int = 4, n_layers: int = 2, max_len: int = 64):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(FusedBlock(dim, heads, max_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.register_buffer("logit_scale", torch.tensor(0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) * self.logit_scale


# --------------------------------------------------------------------------------------------


def eager_and_traced(model: nn.Module, batch: dict, *, max_norm: float = 1.0, seed: int | None = None):
    """(loss, grad_norm, grads) from eager autograd and from the traced graph, from identical starts."""
    eager_model = copy.deepcopy(model)
    if seed is not None:
        torch.manual_seed(seed)
    loss_e, norm_e = EagerStep(eager_model, max_norm=max_norm)(batch)
    grads_e = [p.grad for p in eager_model.parameters()]
    if seed is not None:
        torch.manual_seed(seed)
    step = GraphStep(model, max_norm=max_norm)
    loss_t, norm_t = step(batch)
    grads_t = [p.grad for p in model.parameters()]
    return (loss_e, norm_e, grads_e), (loss_t, norm_t, grads_t)


def assert_bitwise(eager, traced):
    (loss_e, norm_e, grads_e), (loss_t, norm_t, grads_t) = eager, traced
    assert torch.equal(loss_e, loss_t), (loss_e.item(), loss_t.item())
    assert torch.equal(norm_e, norm_t)
    assert len(grads_e) == len(grads_t)
    for i, (ge, gt) in enumerate(zip(grads_e, grads_t, strict=True)):
        assert torch.equal(ge, gt), f"grad {i} differs"


def test_llama_gqa_loss_and_grads_bitwise_equal_to_eager():
    model = tiny_llama()
    assert model.args.n_kv_heads < model.args.n_heads
    assert_bitwise(*eager_and_traced(model, make_batch(96)))


def test_independent_model_bitwise_equal_to_eager():
    model = IndependentLM()
    torch.manual_seed(3)
    assert_bitwise(*eager_and_traced(model, make_batch(80)))


def test_tied_embeddings_get_one_gradient_equal_to_eager():
    model = tiny_llama(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    eager, traced = eager_and_traced(model, make_batch(96))
    assert_bitwise(eager, traced)
    assert len(traced[2]) == len(list(model.parameters()))  # the shared weight appears once


def test_dropout_consumes_rng_like_eager():
    model = tiny_llama(dropout=0.25)
    batch = make_batch(96)
    eager, traced = eager_and_traced(model, batch, seed=123)
    assert_bitwise(eager, traced)
    # and dropout really is active: another seed gives another loss
    torch.manual_seed(999)
    other, _ = GraphStep(copy.deepcopy(model), max_norm=1.0)(batch)
    assert not torch.equal(other, traced[0])


def test_ignore_index_labels_bitwise_equal_to_eager():
    batch = make_batch(96)
    batch["labels"][0, :5] = IGNORE_INDEX
    batch["labels"][1, -3:] = IGNORE_INDEX
    assert_bitwise(*eager_and_traced(tiny_llama(), batch))


def test_random_ops_are_marked():
    model = tiny_llama(dropout=0.1)
    traced = trace_step(model, make_batch(96))
    random_nodes = [n for n in traced.gm.graph.nodes if node_meta.is_random(n)]
    assert random_nodes, "dropout ops must be marked random"
    for n in random_nodes:
        assert torch.Tag.nondeterministic_seeded in n.target.tags
    # Attention kernels carry the seeded tag for their dropout_p, but draw nothing when it is 0.
    no_dropout = trace_step(tiny_llama(), make_batch(96))
    sdpa = [
        n
        for n in no_dropout.gm.graph.nodes
        if n.target == torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    ]
    assert sdpa and torch.Tag.nondeterministic_seeded in sdpa[0].target.tags
    assert not any(node_meta.is_random(n) for n in no_dropout.gm.graph.nodes)


# ----------------------------------------------------------------------------- annotations


def test_annotation_invariants_on_debug_model():
    model = Transformer(build_model_args("llama3", "debugmodel", {"vocab_size": 258}))
    traced = trace_step(model, make_batch(258, batch=1, seq=32), max_norm=1.0)
    nodes = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    phases = [node_meta.phase(n) for n in nodes]
    assert None not in phases, "every op must carry a phase"
    backward_idx = [i for i, p in enumerate(phases) if p == node_meta.BACKWARD]
    # one contiguous backward region, after every forward op (the loss included)
    assert backward_idx == list(range(backward_idx[0], backward_idx[-1] + 1))
    last_forward = max(i for i, p in enumerate(phases) if p == node_meta.FORWARD)
    assert last_forward < backward_idx[0]
    loss_ops = [i for i, n in enumerate(nodes) if "nll_loss_forward" in str(n.target)]
    assert loss_ops and loss_ops[0] < backward_idx[0]
    # forward nodes of the model carry module FQN and layer; backward nodes inherit them
    layer_nodes = {node_meta.layer_id(n) for n in nodes if node_meta.is_forward(n)}
    assert set(range(6)) <= layer_nodes
    bwd_layers = {node_meta.layer_id(n) for n in nodes if node_meta.is_backward(n)}
    assert set(range(6)) <= bwd_layers
    fwd_mm = [n for n in nodes if node_meta.is_forward(n) and n.target == torch.ops.aten.mm.default]
    assert any(node_meta.module_fqn(n) == "layers.0.attention.wq" for n in fwd_mm)
    bwd_mm = [n for n in nodes if node_meta.is_backward(n) and n.target == torch.ops.aten.mm.default]
    assert any(node_meta.module_fqn(n) == "layers.0.attention.wq" for n in bwd_mm)
    assert all(node_meta.layer_id(n) in (None, *range(6)) for n in nodes)
    # the SDPA op of each layer is present (the SAC policy relies on it)
    sdpa = [n for n in nodes if n.target == torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert len(sdpa) == 6


# ----------------------------------------------------------------------------- execution


def test_no_grad_fn_survives_the_step():
    model = tiny_llama()
    step = GraphStep(model, max_norm=1.0)
    loss, norm = step(make_batch(96))
    assert loss.grad_fn is None and norm.grad_fn is None
    for p in model.parameters():
        assert p.grad is not None and p.grad.grad_fn is None and not p.grad.requires_grad
        assert p.grad.shape == p.shape and p.grad.stride() == p.stride()


def test_no_grad_execution_peaks_below_grad_enabled():
    model = tiny_llama()
    batch = make_batch(96, batch=4, seq=32)
    traced = trace_step(model, batch, max_norm=1.0)
    flat = [*model.parameters(), *model.buffers(), *batch.values()]

    def peak(grad_enabled: bool) -> int:
        tracker = LiveTensorTracker()
        tracker.track_existing(flat)
        with torch.set_grad_enabled(grad_enabled), tracker:
            out = traced.gm(*flat)
            del out
        peak_bytes = tracker.peak_bytes
        tracker.forget()
        return peak_bytes

    with_no_grad, with_grad = peak(False), peak(True)
    assert with_no_grad < with_grad, (with_no_grad, with_grad)


def test_fixed_shape_run_traces_once_and_new_shape_retraces_with_reason(caplog):
    caplog.set_level(logging.INFO, logger="graph_trainer")
    model = tiny_llama()
    step = GraphStep(model, max_norm=1.0)
    for seed in range(4):
        step(make_batch(96, seq=16, seed=seed))
    assert step.stats.count == 1 and not step.stats.reasons
    step(make_batch(96, seq=8))
    assert step.stats.count == 2
    assert len(step.stats.reasons) == 1 and "(2, 16) -> (2, 8)" in step.stats.reasons[0]
    assert caplog.messages and "retracing" in caplog.messages[0]


def test_shape_change_with_error_policy_is_a_user_error():
    step = GraphStep(tiny_llama(), on_shape_change="error")
    step(make_batch(96, seq=16))
    with pytest.raises(UserError, match="on_shape_change"):
        step(make_batch(96, seq=8))


def eager_and_graph_adamw(model_e: nn.Module, model_t: nn.Module):
    """(torch AdamW, eager step) for `model_e` and (torch AdamW, graph step with it traced in) for
    `model_t`, each AdamW over its model's trainable parameters."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_e = torch.optim.AdamW([p for p in model_e.parameters() if p.requires_grad], **kw)
    opt_t = torch.optim.AdamW([p for p in model_t.parameters() if p.requires_grad], **kw)
    return (opt_e, EagerStep(model_e, max_norm=1.0)), (
        opt_t,
        GraphStep(model_t, max_norm=1.0, optimizer=GraphAdamW(opt_t)),
    )


def test_optimizer_in_graph_matches_torch_adamw_over_five_steps():
    model_e, model_t = tiny_llama(), tiny_llama()
    (opt_e, eager), (opt_t, graph) = eager_and_graph_adamw(model_e, model_t)
    sched_e = torch.optim.lr_scheduler.LambdaLR(opt_e, lambda s: (s + 1) / 3)
    sched_t = torch.optim.lr_scheduler.LambdaLR(opt_t, lambda s: (s + 1) / 3)
    for i in range(5):
        batch = make_batch(96, seed=i)
        loss_e, _ = eager(batch)
        opt_e.step()
        sched_e.step()
        loss_t, _ = graph(batch)
        sched_t.step()
        assert torch.equal(loss_e, loss_t), f"step {i}"
    assert graph.stats.count == 1
    for pe, pt in zip(model_e.parameters(), model_t.parameters(), strict=True):
        assert torch.equal(pe, pt)
        se, st = opt_e.state[pe], opt_t.state[pt]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(se[key], st[key]), key


def test_unsupported_adamw_option_is_refused_at_start():
    model = tiny_llama()
    with pytest.raises(UserError, match="amsgrad"):
        GraphAdamW(torch.optim.AdamW(model.parameters(), amsgrad=True))


# ----------------------------------------------------------------------------- loud failures


class DataDependentBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent Python control flow
            y = y * 2
        return y


class ItemBlock(DataDependentBlock):
    def forward(self, x):
        return self.lin(x) * x.max().item()


@torch.library.custom_op("graph_trainer_test::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class NoFakeBlock(DataDependentBlock):
    def forward(self, x):
        return torch.ops.graph_trainer_test.no_fake(self.lin(x))


class Wrapper(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([block])
        self.out = nn.Linear(8, 10)

    def forward(self, tokens):
        return self.out(self.layers[0](self.emb(tokens)))


@pytest.mark.parametrize(
    "block, source, op, cause",
    [
        (DataDependentBlock, "if y.sum() > 0", "_local_scalar_dense", "reads a tensor's value"),
        (ItemBlock, ".item()", "_local_scalar_dense", "reads a tensor's value"),
        (NoFakeBlock, "no_fake", "no_fake", "fake"),
    ],
)
def test_untraceable_code_fails_loudly_with_module_line_and_op(tmp_path, block, source, op, cause):
    model = Wrapper(block())
    with pytest.raises(TraceError) as info:
        trace_step(model, make_batch(10, seq=4), failure_dir=tmp_path)
    msg = str(info.value)
    assert "\n" not in msg
    assert "module 'layers.0'" in msg
    assert "test_tracer.py:" in msg and source in msg
    assert op in msg
    assert cause in msg
    assert (tmp_path / "partial_graph.py").read_text().strip()


def test_compiled_autograd_is_rejected(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "compiled_autograd", True)
    with pytest.raises(TraceError, match="compiled autograd"):
        trace_step(tiny_llama(), make_batch(96))


def test_trace_on_meta_model_allocates_nothing():
    args = build_model_args("llama3", "debugmodel", {"vocab_size": 258})
    with torch.device("meta"):
        model = Transformer(args)
    batch = {k: v.to("meta") for k, v in make_batch(258, batch=2, seq=64).items()}
    traced = trace_step(model, batch, device="cpu", max_norm=1.0)
    vals = [n.meta["val"] for n in traced.gm.graph.nodes if n.op == "placeholder"]
    assert all(v.device.type == "cpu" for v in vals)
    assert math.isfinite(traced.trace_time_s)
