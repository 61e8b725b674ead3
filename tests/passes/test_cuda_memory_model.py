"""The static estimate counts what CUDA's caching allocator counts, checked without a GPU.

A graph traced on fake CUDA tensors (this needs no GPU) is estimated with each
storage rounded up to 512 bytes, host scalars left out, and the cuBLAS workspace
added when it has a matmul. These rules come from torch's allocator and cuBLAS
handle code; whether they bring the estimate within 1% of a GPU's measured
active peak is unverified until run on one (see docs/passes_and_memory.md).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.observability.memory import (
    CUBLAS_WORKSPACE_DEFAULT_BYTES,
    CUBLAS_WORKSPACE_SM90_BYTES,
    allocated_bytes,
    cublas_workspace_bytes,
)
from graph_trainer.tracer.memory_estimate import WORKSPACE, estimate_peak_memory


def test_cuda_allocations_round_up_to_512_bytes_and_cpu_ones_do_not():
    assert allocated_bytes(0, "cuda") == 0
    assert allocated_bytes(1, "cuda") == 512
    assert allocated_bytes(512, "cuda") == 512
    assert allocated_bytes(513, "cuda") == 1024
    assert allocated_bytes(513, "cpu") == 513


def test_cublas_workspace_follows_torch_defaults_and_the_environment():
    assert cublas_workspace_bytes(None, (9, 0)) == CUBLAS_WORKSPACE_SM90_BYTES == 32 * 1024**2
    assert cublas_workspace_bytes(None, (8, 0)) == CUBLAS_WORKSPACE_DEFAULT_BYTES
    assert cublas_workspace_bytes(None, None) == CUBLAS_WORKSPACE_SM90_BYTES  # planning without a GPU
    assert cublas_workspace_bytes(":4096:8", (8, 0)) == 32 * 1024**2  # what training.deterministic sets
    assert cublas_workspace_bytes(":4096:2:16:8", (9, 0)) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cublas_workspace_bytes("garbage", (9, 0)) == 0  # torch, too, sums only ":SIZE:COUNT" matches


def _step(w: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu().sum() * scale


def _estimate(device: str, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        w = torch.empty(3, 5, device=device)  # 60 B -> one 512 B block on CUDA
        x = torch.empty(7, 3, device=device)
        scale = torch.empty((), dtype=torch.float64)  # a host scalar, as the optimizer's are
        gm = make_fx(_step, tracing_mode="fake")(w, x, scale)
    return estimate_peak_memory(gm)


def test_estimate_of_a_fake_cuda_graph_uses_the_allocator_model(monkeypatch):
    cpu, cuda = _estimate("cpu", monkeypatch), _estimate("cuda", monkeypatch)
    assert WORKSPACE not in cpu.peak_bytes_by_category
    assert cuda.peak_bytes_by_category[WORKSPACE] == 32 * 1024**2
    # Inputs: w (60 B) and x (84 B) one block each; the host scalar counts on CPU only.
    assert cpu.input_bytes == 60 + 84 + 8
    assert cuda.input_bytes == 32 * 1024**2 + 2 * 512
    # Peak at mm/relu: inputs plus two 7x5 fp32 (140 B) tensors, each a block on CUDA.
    assert cuda.peak_bytes == 32 * 1024**2 + 4 * 512
