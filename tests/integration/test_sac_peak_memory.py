"""Graph SAC never uses more memory than eager torch.utils.checkpoint with the same policy.

For `selective` and `full`, through the real Trainer on CPU: traced peak <=
eager-checkpoint peak (ratio threshold 1.00), the static estimate equals the
measured peak to the byte, and losses and gradients are bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer_runs import train, train_in_own_process

pytestmark = pytest.mark.integration

# Enough tokens that activations dominate the peak; a shallow and a deep model, because graph
# `full` saves attention outputs in the first and recomputes them in the second.
SHAPES = {
    "4 layers": [
        "--model.n_layers",
        "4",
        "--model.dim",
        "128",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
    ],
    "12 layers": [
        "--model.n_layers",
        "12",
        "--model.dim",
        "64",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "4",
    ],
}
SHAPE = SHAPES["4 layers"]
RATIO_LIMIT = 1.00


@pytest.fixture(scope="module")
def no_checkpoint_runs() -> dict:
    """Each shape trained without checkpointing, once for both modes (they compare with the same run)."""
    return {}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_graph_sac_peak_at_most_eager_checkpoint_peak(tmp_path, tmp_path_factory, no_checkpoint_runs, mode, shape):
    ac = ["--activation_checkpoint.mode", mode]
    eager, _ = train(tmp_path / "eager", *SHAPES[shape], *ac, "--compile.mode", "eager", steps=3)
    traced, _ = train(tmp_path / "traced", *SHAPES[shape], *ac, steps=3)
    if shape not in no_checkpoint_runs:
        no_checkpoint_runs[shape] = train(tmp_path_factory.mktemp("none"), *SHAPES[shape], steps=3)[0]
    none = no_checkpoint_runs[shape]

    eager_peak = max(r["peak_active_bytes"] for r in eager.records)
    traced_peaks = [r["peak_active_bytes"] for r in traced.records]
    estimates = [r["estimated_peak_bytes"] for r in traced.records]
    assert traced_peaks == estimates, "the static estimate must equal the measured CPU peak to the byte"
    ratio = max(traced_peaks) / eager_peak
    print(f"{shape} {mode}: traced {max(traced_peaks)} B, eager checkpoint {eager_peak} B, ratio {ratio:.3f}")
    assert ratio <= RATIO_LIMIT

    assert traced.losses == eager.losses == none.losses
    assert traced.params_sha256 == eager.params_sha256 == none.params_sha256
    assert traced.grads_sha256 == eager.grads_sha256 == none.grads_sha256


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_cuda_graph_sac_active_and_reserved_at_most_eager(tmp_path, mode):
    """Each run in its own process: the CUDA allocator's peaks are the process's, and with both trainers in one
    process the traced run was charged the eager one's state and cached blocks (H200, torch 2.11: traced
    0.10 GiB active against eager 0.08, where the traced step's own estimate was 0.05)."""
    cuda = ["--training.device", "cuda", *SHAPE, "--activation_checkpoint.mode", mode]
    eager = train_in_own_process(tmp_path / "eager", *cuda, "--compile.mode", "eager", steps=3)["steps"]
    traced = train_in_own_process(tmp_path / "traced", *cuda, steps=3)["steps"]
    for key in ("peak_active_bytes", "peak_reserved_bytes"):
        eager_peak = max(r[key] for r in eager)
        traced_peak = max(r[key] for r in traced)
        print(f"{mode} {key}: traced {traced_peak} B, eager checkpoint {eager_peak} B")
        assert traced_peak <= eager_peak * RATIO_LIMIT, key
