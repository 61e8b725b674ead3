"""DeepSeek-V3: the model (`model.py`), its named sizes (`flavors.py`) and its registry entry (`SPEC`)."""

from models.common.spec import ModelSpec, ParallelPlan
from models.deepseek_v3.flavors import DEEPSEEK_V3_FLAVORS
from models.deepseek_v3.hf_config import args_from_hf_config
from models.deepseek_v3.model import (
    DeepSeekV3,
    ModelArgs,
    Router,
    active_params,
    expert_load,
    flops_per_token,
    num_params,
    rebalance,
)
from models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

SPEC = ModelSpec(
    name="deepseek_v3",
    args_cls=ModelArgs,
    model_cls=DeepSeekV3,
    flavors=DEEPSEEK_V3_FLAVORS,
    num_params=num_params,
    flops_per_token=flops_per_token,
    parallel_plan=ParallelPlan(layers="layers", routed_experts="moe.experts"),
    active_params=active_params,
    step_metrics=expert_load,
    step_update=rebalance,
    leading_blocks=lambda args: args.n_dense_layers,  # dense FFNs before the mixtures of experts
    hf_names=("deepseek_v3", "DeepseekV3ForCausalLM"),
    args_from_hf_config=args_from_hf_config,
    hf_adapter=DeepSeekV3StateDictAdapter,
)

__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "DeepSeekV3StateDictAdapter",
    "SPEC",
    "DeepSeekV3",
    "ModelArgs",
    "Router",
    "active_params",
    "args_from_hf_config",
    "expert_load",
    "flops_per_token",
    "num_params",
    "rebalance",
]
