"""Llama 3: the model (`model.py`), its named sizes (`flavors.py`) and its registry entry (`SPEC`)."""

from models.common.spec import ModelSpec, ParallelPlan
from models.llama3.flavors import LLAMA3_FLAVORS
from models.llama3.model import (
    ModelArgs,
    Transformer,
    ffn_hidden_dim,
    flops_per_token,
    num_params,
    num_params_from_args,
)
from models.llama3.state_dict_adapter import Llama3StateDictAdapter

SPEC = ModelSpec(
    name="llama3",
    args_cls=ModelArgs,
    model_cls=Transformer,
    flavors=LLAMA3_FLAVORS,
    num_params=num_params_from_args,
    flops_per_token=flops_per_token,
    parallel_plan=ParallelPlan(layers="layers"),
    hf_adapter=Llama3StateDictAdapter,
)

__all__ = [
    "LLAMA3_FLAVORS",
    "Llama3StateDictAdapter",
    "SPEC",
    "ModelArgs",
    "Transformer",
    "ffn_hidden_dim",
    "flops_per_token",
    "num_params",
    "num_params_from_args",
]
