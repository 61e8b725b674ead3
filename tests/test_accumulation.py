"""Gradient accumulation (`training.global_batch_size`): micro-batches that add up to the big batch, bitwise.

Claims tested:
- the traced accumulated step (micro graph + update graph) is bitwise equal to eager accumulation (autograd adding
  into `param.grad`), in AC modes none/selective/full, with the AdamW update in and out of the graph, and with the
  chunked loss;
- it equals ONE step on the whole batch within a stated tolerance when the micro-batches hold very uneven numbers
  of valid tokens (the loss is normalised by the step's count, not each micro-batch's): a mean of micro-batch
  means misses by far more than the tolerance, so the comparison can fail;
- the micro graph does not depend on the number of micro-batches: the planner traces the same two graphs for 2
  and 8 (its work does not grow with them);
- a global batch that does not divide is one line and exit 2; a resume that changes the accumulation steps is
  refused in one line, one that keeps them is honoured.
"""

from __future__ import annotations

import pytest
import torch

from graph_trainer.__main__ import main
from graph_trainer.builder import build_job
from graph_trainer.distributed.launch import single_process
from graph_trainer.job_config.cli import load_config
from graph_trainer.loss import IGNORE_INDEX, lm_loss
from graph_trainer.plan.step_plan import plan_step
from tests.tiny import DETERMINISTIC, tiny_model

B, S, K = 2, 32, 4  # micro-batches of 2 x 32 tokens, 4 of them a step
# Valid labels per micro-batch (of 64): very uneven, so a mean of the micro-batches' means is far from the mean.
VALID = (3, 64, 20, 41)
BASE = ["--config", "llama3_debug", *tiny_model(), *DETERMINISTIC, "--training.seq_len", str(S)]
# Summation order differs from the whole batch's (per micro-batch partial sums, then the accumulation), in fp32
# over 128 valid tokens: measured here, at most 1.1e-8 absolute (3.4e-7 of the tensor's largest entry) on
# gradients up to 4e-2, and 4.8e-7 on a loss of ~5.5. 1e-5 relative leaves room for other CPUs' kernels and is
# still 100x tighter than what a mean of micro-batch means gets wrong (asserted in the test).
RTOL, ATOL = 1e-5, 1e-7


def _job(*overrides: str, local: int = B, steps: int = K):
    cfg, _ = load_config(
        [*BASE, "--training.local_batch_size", str(local), "--training.global_batch_size", str(local * steps)]
        + list(overrides)
    )
    torch.use_deterministic_algorithms(True)
    return build_job(cfg, single_process(cfg))


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """One step's batch (K micro-batches of B x S), with only VALID[i] labels counted in micro-batch i."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (K * B, S + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    for i, valid in enumerate(VALID):
        micro = labels[i * B : (i + 1) * B].view(-1)
        micro[valid:] = IGNORE_INDEX
    return {"input": tokens[:, :-1].contiguous(), "labels": labels}


def _train(step, job, batches) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    out = [step(b) for b in batches]
    return [t for o in out for t in o], {n: p.detach().clone() for n, p in job.model.named_parameters()}


SLOW = pytest.mark.integration  # ~15-25 s each on 2 busy cores: the CI budget keeps one case in the quick suite


@pytest.mark.parametrize(
    "ac,in_graph",
    [
        pytest.param("none", False, marks=SLOW),
        pytest.param("none", True, marks=SLOW),
        pytest.param("selective", False, marks=SLOW),
        ("full", True),
    ],
    ids=["none", "none-optimizer_in_graph", "selective", "full-optimizer_in_graph"],
)
def test_traced_accumulation_is_bitwise_equal_to_eager_accumulation(ac, in_graph):
    extra = ["--activation_checkpoint.mode", ac, "--compile.trace_optimizer", str(in_graph).lower()]
    batches = [_batch(0), _batch(1)]
    eager_job = _job(*extra, "--compile.mode", "eager")
    eager = _train(eager_job.build_step(), eager_job, batches)
    traced_job = _job(*extra)
    step = traced_job.build_step()
    traced = _train(step, traced_job, batches)
    assert step.report().trace_count == 2  # the micro graph and the update graph, once each for both steps
    for a, b in zip(eager[0], traced[0], strict=True):
        assert torch.equal(a, b)
    for name, p in eager[1].items():
        assert torch.equal(p, traced[1][name]), name


def _grads(job, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    step = job.build_step(optimizer_update=False)
    loss, _ = step(batch)
    return loss, {n: p.grad.clone() for n, p in job.model.named_parameters()}


@pytest.mark.parametrize("mode", ["trace", pytest.param("eager", marks=SLOW)])
def test_accumulated_gradient_equals_one_big_batch_with_uneven_valid_tokens(mode):
    batch = _batch()
    one = ["--compile.mode", mode, "--training.max_norm", "0"]
    loss, grads = _grads(_job(*one), batch)
    big_loss, big_grads = _grads(_job(*one, local=K * B, steps=1), batch)
    torch.testing.assert_close(loss, big_loss, rtol=RTOL, atol=ATOL)
    for name in grads:
        torch.testing.assert_close(grads[name], big_grads[name], rtol=RTOL, atol=ATOL, msg=name)
    # What a mean of the micro-batch means would give (each micro-batch's own mean, averaged): caught by far.
    model = _job(*one).model
    for i in range(K):
        lm_loss(model, {k: v[i * B : (i + 1) * B] for k, v in batch.items()}).div(K).backward()
    worst = max(
        ((p.grad - big_grads[n]).abs().max() / big_grads[n].abs().max()).item() for n, p in model.named_parameters()
    )
    assert worst > 100 * RTOL, worst


@SLOW
def test_chunked_loss_accumulates_bitwise_in_trace_and_eager_and_matches_the_unchunked():
    chunk = ["--training.loss_chunk_size", "16", "--training.max_norm", "0"]
    batch = _batch()
    traced_loss, traced = _grads(_job(*chunk), batch)
    eager_loss, eager = _grads(_job(*chunk, "--compile.mode", "eager"), batch)
    plain_loss, plain = _grads(_job("--training.max_norm", "0"), batch)
    assert torch.equal(traced_loss, eager_loss)
    # tests/test_loss.py's stated tolerance for chunked against unchunked.
    torch.testing.assert_close(traced_loss, plain_loss, rtol=1e-5, atol=1e-7)
    for name in traced:
        assert torch.equal(traced[name], eager[name]), name
        torch.testing.assert_close(traced[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_plan_traces_the_same_two_graphs_whatever_the_number_of_micro_batches():
    ops = {}
    for steps in (2, 8):
        job = _job(local=B, steps=steps)
        plan = plan_step(job)
        step = plan.step_graph.traced
        ops[steps] = [str(n.target) for n in step.gm.graph.nodes]
        assert plan.trace_time_s > 0
    assert ops[2] == ops[8]  # one micro graph, whatever the number of micro-batches


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--training.global_batch_size", "5"], ["training.global_batch_size = 5", "use 4 or 6"]),
        (["--training.global_batch_size", "0"], ["training.global_batch_size = 0", "-1 for no accumulation"]),
        (["--parallelism.fsdp_grad_sync", "step"], ['fsdp_grad_sync = "step"', "parallelism.dp_shard > 1"]),
    ],
    ids=["not_a_multiple", "zero", "step_sync_without_fsdp"],
)
def test_a_bad_accumulation_option_is_one_line_and_exit_2(capsys, args, expected):
    code = main([*BASE, "--training.local_batch_size", "2", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err, err


def test_a_resume_that_changes_the_accumulation_is_refused_in_one_line(tmp_path, capsys):
    run = [*BASE, "--training.local_batch_size", "2", "--training.steps", "1", "--compile.mode", "eager"]
    run += ["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true", "--training.global_batch_size"]
    assert main([*run, "4"]) == 0
    capsys.readouterr()
    resume = ["--checkpoint.resume", "true", "--training.steps", "2"]
    assert main([*run, "8", *resume]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "4 accumulation steps; checkpoint: 4, 2 steps" in err and "--training.global_batch_size 4" in err
    # The same accumulation written another way (local 2 x dp 1 x 2 steps) is honoured.
    assert main([*run, "4", *resume]) == 0
