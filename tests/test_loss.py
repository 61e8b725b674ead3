"""Chunked cross-entropy: no full logits tensor, logits recomputed in the backward, numerics pinned.

Tolerance, stated once: against the unchunked `lm_loss` the chunked loss adds
per-chunk sums (and per-chunk weight gradients) in another order and forms the
logits gradient as softmax minus one-hot instead of through log_softmax's
backward, so it is not bitwise; it agrees within rtol 1e-5 / atol 1e-7 (fp32).
The traced chunked step is bitwise equal to the eager chunked step.
"""

from __future__ import annotations

import pytest
import torch

from graph_trainer.distributed.vocab_parallel import VocabParallelLoss
from graph_trainer.eager.step import EagerStep
from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from graph_trainer.loss import IGNORE_INDEX, build_lm_loss, chunked_lm_loss, lm_loss
from graph_trainer.plan.step_plan import plan_config
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import trace_step
from models.llama3.model import ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=64)
B, S, CHUNK = 2, 24, 16  # 48 tokens: chunks of 16, 16 and 16


def _model_and_batch():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    tokens = torch.randint(0, ARGS.vocab_size, (B, S + 1))
    labels = tokens[:, 1:].clone()
    labels[0, :5] = IGNORE_INDEX  # ignored tokens must not count
    return model, {"input": tokens[:, :-1].contiguous(), "labels": labels}


def _loss_and_grads(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_chunked_loss_matches_unchunked_within_the_stated_tolerance():
    model, batch = _model_and_batch()
    loss, grads = _loss_and_grads(model, batch, lm_loss)
    c_loss, c_grads = _loss_and_grads(model, batch, build_lm_loss(CHUNK))
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-7)
    for name in grads:
        torch.testing.assert_close(c_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # One chunk covering every token is still the chunked algorithm: same tolerance, nothing more promised.
    one_loss, _ = _loss_and_grads(model, batch, build_lm_loss(B * S))
    torch.testing.assert_close(one_loss, loss, rtol=1e-5, atol=1e-7)


def test_traced_chunked_step_is_bitwise_equal_to_eager_chunked_step():
    model, batch = _model_and_batch()
    loss_fn = build_lm_loss(CHUNK)
    eager_loss, eager_norm = EagerStep(model, loss_fn=loss_fn, max_norm=1.0)(batch)
    eager_grads = [p.grad.clone() for p in model.parameters()]
    traced = trace_step(model, batch, loss_fn=loss_fn, max_norm=1.0)
    flat = [*model.parameters(), *model.buffers(), batch["input"], batch["labels"]]
    loss, norm, grads = traced(flat)
    assert torch.equal(loss, eager_loss) and torch.equal(norm, eager_norm)
    for g, e in zip(grads, eager_grads, strict=True):
        assert torch.equal(g, e)


def test_graph_never_holds_full_logits_and_recomputes_each_chunk_in_the_backward():
    model, batch = _model_and_batch()
    traced = trace_step(model, batch, loss_fn=build_lm_loss(CHUNK))
    full, chunk = (B * S, ARGS.vocab_size), (CHUNK, ARGS.vocab_size)
    shapes = {}
    for n in traced.gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert tuple(val.shape) != full, f"{n.name} is a full logits tensor"
            if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and tuple(val.shape) == chunk:
                shapes.setdefault(node_meta.phase(n), []).append(n.name)
    assert len(shapes[node_meta.FORWARD]) == 3  # three chunks' logits in the forward ...
    assert len(shapes[node_meta.BACKWARD]) == 3  # ... and again, recomputed, in the backward


def test_chunking_lowers_the_planned_peak_where_the_loss_was_the_peak():
    flags = [
        "--config",
        "llama3_debug",
        "--model.vocab_size",
        "8192",
        "--model.n_layers",
        "1",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "4",
    ]
    plans = {}
    for chunk in (0, 128):
        cfg, _ = load_config([*flags, "--training.loss_chunk_size", str(chunk)])
        plans[chunk] = plan_config(cfg, torch.device("cpu"))
    logits_bytes = 4 * 256 * 8192 * 4
    assert plans[0].peak_bytes - plans[128].peak_bytes >= 2 * logits_bytes


def test_chunked_loss_refuses_a_model_without_hidden_states():
    with pytest.raises(UserError, match="loss_chunk_size = 0"):
        chunked_lm_loss(torch.nn.Linear(3, 3), {"input": torch.zeros(1, 2, dtype=torch.long)}, chunk_size=4)


class _OneRankShard(VocabParallelLoss):
    """A vocabulary shard holding the whole vocabulary (then padding columns): no other rank to reduce over."""

    def __init__(self, vocab: int):
        self.start, self.valid = 0, vocab

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return t

    def gather_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def test_vocab_parallel_loss_of_one_shard_is_cross_entropy_and_ignores_padding_logits():
    """The vocabulary-parallel loss with one shard is F.cross_entropy up to summation order (1e-6 on a loss of
    ~3, 1e-7 on gradients of ~0.01: the CPU log-softmax kernel sums exponentials in vector lanes, we with
    torch.sum); padding columns (here huge values, which would dominate an unmasked softmax) do not count and
    get exactly zero gradient."""
    from graph_trainer.loss import cross_entropy_loss, vocab_parallel

    torch.manual_seed(0)
    vocab, pad = 11, 3
    logits = torch.randn(2, 5, vocab + pad, dtype=torch.float64).float()
    logits[..., vocab:] = 1e4
    labels = torch.randint(0, vocab, (2, 5))
    labels[0, 1] = IGNORE_INDEX
    mine = logits.clone().requires_grad_()
    with vocab_parallel(_OneRankShard(vocab)):
        loss = cross_entropy_loss(mine, labels)
    loss.backward()
    ref = logits[..., :vocab].clone().requires_grad_()
    expected = cross_entropy_loss(ref, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(mine.grad[..., :vocab], ref.grad, rtol=0, atol=1e-7)
    assert torch.equal(mine.grad[..., vocab:], torch.zeros(2, 5, pad))


@pytest.mark.parametrize("chunked", [False, True], ids=["plain", "chunked"])
def test_vocab_parallel_losses_divide_by_the_step_token_count_as_the_others_do(chunked):
    """With `num_tokens` (a micro-batch of an accumulated step) the vocabulary-parallel losses of one shard, plain and
    chunked, are the losses without tensor parallelism given the same count: the sum over the valid tokens divided
    by it, not by this batch's own count (here 43 valid tokens and a count of 100). Tolerance: the one-shard test's
    above (summation order of the log-sum-exp), 1e-6 on the loss and 1e-7 on the gradients."""
    from graph_trainer.loss import NUM_TOKENS, vocab_parallel

    model, batch = _model_and_batch()
    batch = {**batch, NUM_TOKENS: torch.tensor(100.0)}
    loss_fn = build_lm_loss(CHUNK if chunked else 0)
    with vocab_parallel(_OneRankShard(ARGS.vocab_size)):
        loss, grads = _loss_and_grads(model, batch, loss_fn)
    expected, expected_grads = _loss_and_grads(model, batch, loss_fn)
    own_count = _loss_and_grads(model, {k: v for k, v in batch.items() if k != NUM_TOKENS}, loss_fn)[0]
    assert abs(own_count / expected - 100 / 43) < 1e-5  # the count is what tells them apart
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, expected_grads[name], rtol=0, atol=1e-7, msg=name)
