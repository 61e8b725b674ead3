"""Every execution mode gives bitwise the same training run as eager PyTorch, through the real Trainer.

Five steps from one seed, CPU fp32 with deterministic kernels: each step's loss
is torch.equal across modes (summary.json keeps losses exactly) and the sha256
of the final parameters and gradients match. Modes: eager, trace, trace with
selective / full / budget activation checkpointing, and the optimizer in the graph.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer_runs import MODES, train, train_in_own_process

pytestmark = pytest.mark.integration

VARIANTS = {
    "gqa": [],
    "tied": ["--model.tie_embeddings", "true"],
    "dropout": ["--model.dropout", "0.1"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_mode_matches_eager_bitwise(tmp_path, variant):
    results = {mode: train(tmp_path / mode, *VARIANTS[variant], *flags)[0] for mode, flags in MODES.items()}
    eager = results["eager"]
    assert len(eager.losses) == 5
    for mode, result in results.items():
        assert result.losses == eager.losses, f"{variant}/{mode}: losses differ"
        assert torch.equal(torch.tensor(result.losses), torch.tensor(eager.losses))
        assert result.params_sha256 == eager.params_sha256, f"{variant}/{mode}: final parameters differ"
        assert result.grads_sha256 == eager.grads_sha256, f"{variant}/{mode}: final gradients differ"
        if mode != "eager":
            assert result.trace_count == 1, f"{variant}/{mode} traced {result.trace_count} times"


def test_dropout_really_changes_the_run(tmp_path):
    plain, _ = train(tmp_path / "plain")
    dropped, _ = train(tmp_path / "dropout", *VARIANTS["dropout"])
    assert plain.losses != dropped.losses


def test_same_traced_config_in_two_processes_is_identical(tmp_path):
    selective = ("--activation_checkpoint.mode", "selective")
    first, second = (train_in_own_process(tmp_path / run, *selective) for run in "ab")
    assert [s["loss"] for s in first["steps"]] == [s["loss"] for s in second["steps"]]
    for key in ("params_sha256", "grads_sha256"):
        assert first["final"][key] == second["final"][key]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["trace", "trace+selective", "trace+full"])
def test_cuda_traced_matches_eager_bitwise(tmp_path, mode):
    cuda = ["--training.device", "cuda", "--training.dtype", "float32"]
    eager, _ = train(tmp_path / "eager", *cuda, *MODES["eager"])
    traced, _ = train(tmp_path / mode, *cuda, *MODES[mode])
    assert traced.losses == eager.losses
    assert traced.params_sha256 == eager.params_sha256
    assert traced.grads_sha256 == eager.grads_sha256
