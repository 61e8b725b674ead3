"""Content digests of tensors: how runs in separate processes prove they ended bitwise equal."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping

import torch


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes of `tensors`, in key order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()
