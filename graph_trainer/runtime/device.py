"""Device policy: which device and compute dtype a job runs on, and how it is made deterministic."""

from __future__ import annotations

import os
import random

import torch

from graph_trainer.errors import UserError


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when available; asking for CUDA without it is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "training.device = 'cuda' but no CUDA device is available; use training.device = 'cpu' or 'auto'"
        )
    return torch.device(name)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the config's dtype names


def resolve_dtype(name: str, device: torch.device, mixed_precision_param: str = "float32") -> torch.dtype:
    """Autocast dtype: 'auto' is bf16 autocast on CUDA and fp32 (none) on CPU; parameters stay fp32.

    With FSDP mixed precision (`mixed_precision_param` not float32) the gathered
    parameters set the compute dtype, as in FSDP2, so there is no autocast and
    'auto' is float32 on every device (the config refuses 'bfloat16' with it).
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and mixed_precision_param == "float32" else torch.float32
    return DTYPES[name]


def compute_dtype(name: str, device: torch.device, mixed_precision_param: str = "float32") -> torch.dtype:
    """The dtype the matmuls run in (for logs and MFU): FSDP's parameter dtype when set, else the autocast one."""
    if mixed_precision_param != "float32":
        return DTYPES[mixed_precision_param]
    return resolve_dtype(name, device)


def set_determinism(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed every RNG; with `deterministic`, also force deterministic kernels (CUDA flags included)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        if device.type == "cuda":
            # cuBLAS reads this when its handle is created: before the first matmul.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)


# Dense peak TFLOP/s per GPU by (name fragment, dtype), from the vendors' data sheets (no sparsity).
_PEAK_TFLOPS = {
    ("H200", torch.bfloat16): 989.0,
    ("H100", torch.bfloat16): 989.0,
    ("A100", torch.bfloat16): 312.0,
    ("H200", torch.float32): 67.0,
    ("H100", torch.float32): 67.0,
    ("A100", torch.float32): 19.5,
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's peak FLOP/s for `dtype`, for MFU; None where unknown (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for (fragment, peak_dtype), tflops in _PEAK_TFLOPS.items():
        if fragment in name and peak_dtype == dtype:
            return tflops * 1e12
    return None
