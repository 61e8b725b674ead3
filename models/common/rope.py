"""Rotary position embeddings shared by the model families: the cos/sin tables and the rotation.

A family supplies its own frequencies (Llama 3.1's scaling, DeepSeek's YaRN, ...); the tables and the
rotation of adjacent channel pairs are the same for all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, [max_seq_len, pairs] each, from `frequencies(device)` ([pairs] angles per step).

    Real-valued (not complex) so that every op in the traced graph is an ordinary float op; non-persistent
    buffers because they are derived from the config, not learned.
    """

    def __init__(self, max_seq_len: int, pairs: int, frequencies: Callable[[torch.device], torch.Tensor]):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.frequencies = frequencies
        self.register_buffer("cos", torch.empty(max_seq_len, pairs), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, pairs), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recompute the tables in place (in float32, then cast to the buffers' dtype)."""
        device = self.cos.device
        if device.type == "meta":
            return  # nothing to compute on meta; init_weights() after to_empty() fills them
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, self.frequencies(device))
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, seq_len: int, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions 0 .. seq_len - 1, [seq_len, pairs] each; or of each token's own position,
        [B, seq_len, pairs] each, when `positions` [B, seq_len] is given (positions restarting at each packed
        document: models/common/documents.py)."""
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's max_seq_len {self.max_seq_len}; "
                "raise model max_seq_len or lower the training seq_len"
            )
        if positions is not None:  # every position is below seq_len, so inside the tables
            return self.cos[positions], self.sin[positions]
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (x[2i], x[2i+1]) of x [B, S, H, head_dim] by position-dependent angles.

    `cos` and `sin` are [S, pairs] (the same positions in every row) or [B, S, pairs] (each row its own).
    Adjacent channels form a pair, as in Meta's complex-number formulation, so Meta's wq/wk weights load
    without permutation. Computed in float32.
    """
    x_pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = x_pairs[..., 0], x_pairs[..., 1]
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # broadcast over batch and heads
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
