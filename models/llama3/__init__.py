"""Llama 3: the model (`model.py`), its named sizes (`flavors.py`) and its registry entry (`SPEC`)."""

from models.common.spec import ModelSpec, ParallelPlan, TensorParallelPlan
from models.llama3.flavors import LLAMA3_FLAVORS
from models.llama3.model import (
    ModelArgs,
    Transformer,
    ffn_hidden_dim,
    flops_per_token,
    num_params,
    num_params_from_args,
)
from models.llama3.state_dict_adapter import Llama3StateDictAdapter, args_from_hf_config

# Megatron's split of the Llama block: q/k/v and w1/w3 by output rows, wo and w2 by input columns, so each
# block needs one all-gather before attention and one before the FFN (the norms' outputs, sequence-sharded) and
# one reduce-scatter after wo and one after w2; embeddings and output projection split by vocabulary.
TENSOR_PARALLEL = TensorParallelPlan(
    colwise=("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
    rowwise=("attention.wo", "feed_forward.w2"),
    sequence_regions=("attention", "feed_forward"),
    sequence_parallel=("attention_norm", "ffn_norm"),
    local_counts=(("attention", ("n_heads", "n_kv_heads")),),
    embedding="tok_embeddings",
    output="output",
    final_norm="norm",
)

SPEC = ModelSpec(
    name="llama3",
    args_cls=ModelArgs,
    model_cls=Transformer,
    flavors=LLAMA3_FLAVORS,
    num_params=num_params_from_args,
    flops_per_token=flops_per_token,
    parallel_plan=ParallelPlan(layers="layers", tensor_parallel=TENSOR_PARALLEL),
    hf_adapter=Llama3StateDictAdapter,
    hf_names=("llama", "LlamaForCausalLM"),
    args_from_hf_config=args_from_hf_config,
)

__all__ = [
    "LLAMA3_FLAVORS",
    "Llama3StateDictAdapter",
    "SPEC",
    "TENSOR_PARALLEL",
    "ModelArgs",
    "Transformer",
    "ffn_hidden_dim",
    "flops_per_token",
    "num_params",
    "num_params_from_args",
]
