"""Llama 3: the model (`model.py`) and its named sizes (`flavors.py`)."""

from models.llama3.flavors import LLAMA3_FLAVORS
from models.llama3.model import (
    ModelArgs,
    Transformer,
    ffn_hidden_dim,
    flops_per_token,
    num_params,
    num_params_from_args,
)

__all__ = [
    "LLAMA3_FLAVORS",
    "ModelArgs",
    "Transformer",
    "ffn_hidden_dim",
    "flops_per_token",
    "num_params",
    "num_params_from_args",
]
