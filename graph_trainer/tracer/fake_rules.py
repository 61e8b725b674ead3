"""Fake-tensor rules for ops whose torch fake kernel is narrower than the real one.

`torch._grouped_mm`: torch's meta kernel (2.13) accepts bf16 only, while the CPU kernel (and CUDA's fallback)
runs fp32 too, so a float32 mixture of experts could run eagerly but not be traced. The rule below accepts
what the real kernel accepts (both operands float32 or both bfloat16, 2-D/3-D, matching contraction
dimension, int32 offsets where a 2-D operand needs them, 16-byte row strides) and returns the output the
real kernel allocates (torch's own helper decides its shape and strides). bf16 keeps torch's own checks.
Importing this module registers the rule, once; graph_trainer.tracer imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm
from torch._subclasses import fake_impls

aten = torch.ops.aten
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16)


def _check_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, bias: Any, out_dtype: Any) -> None:
    """The checks the real fp32 kernel makes, as torch._check (the error the real kernel would raise)."""
    torch._check(a.dtype == b.dtype and a.dtype in GROUPED_MM_DTYPES, lambda: f"_grouped_mm: got {a.dtype}, {b.dtype}")
    torch._check(a.dim() in (2, 3) and b.dim() in (2, 3), lambda: "_grouped_mm: operands must be 2-D or 3-D")
    torch._check(a.size(-1) == b.size(-2) or (a.dim() == 2 and b.dim() == 2), lambda: "_grouped_mm: contraction")
    needs_offs = a.dim() == 2 or b.dim() == 2
    torch._check((offs is not None) == needs_offs, lambda: "_grouped_mm: offs given iff an operand is 2-D")
    torch._check(offs is None or (offs.dim() == 1 and offs.dtype == torch.int32), lambda: "_grouped_mm: offs int32")
    torch._check(bias is None, lambda: "_grouped_mm: bias is not supported")
    torch._check(out_dtype is None or out_dtype == a.dtype, lambda: "_grouped_mm: out_dtype must be the inputs'")
    for t in (a, b):  # the real kernel's "strides should be multiple of 16 bytes"
        align = 16 // t.element_size()
        torch._check(
            t.stride(-2) % align == 0 or t.stride(-1) % align == 0, lambda: "strides should be multiple of 16 bytes"
        )


@fake_impls.register_op_impl(aten._grouped_mm.default)
def fake_grouped_mm(
    fake_mode: Any, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor, offs=None, bias=None, out_dtype=None
):
    """aten._grouped_mm on fake tensors: torch's meta kernel for bf16, the real kernel's rules for fp32."""
    with fake_mode:
        if mat_a.dtype == torch.bfloat16:
            return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        _check_grouped_mm(mat_a, mat_b, offs, bias, out_dtype)
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
