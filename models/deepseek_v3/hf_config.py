"""Hugging Face's DeepSeek-V3 `config.json` (transformers' `DeepseekV3Config`) as our `ModelArgs`.

Only the configuration: a folder's `config.json` alone sets the model. The weights' names and layouts are
`state_dict_adapter.py`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from models.common.spec import ModelArgsError
from models.deepseek_v3.model import ModelArgs

# Our field <- config.json key, where the value carries over as it is.
_SAME: dict[str, str] = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_dense_layers": "first_k_dense_replace",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "inter_dim": "intermediate_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "n_activated_experts": "num_experts_per_tok",
    "n_expert_groups": "n_group",
    "n_limited_groups": "topk_group",
    "route_norm": "norm_topk_prob",
    "route_scale": "routed_scaling_factor",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings",
}
# transformers' DeepseekV3Config defaults, for the keys a config.json may leave out.
_HF_DEFAULTS: dict[str, Any] = {
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": 1536,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "scoring_func": "sigmoid",
    "rope_interleave": True,
}


def args_from_hf_config(config: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The `ModelArgs` fields a DeepSeek-V3 `config.json` sets: shapes, the mixture of experts (routed and shared
    experts, top-k, group-limited routing, the gate's normalization and scale), multi-head latent attention (the
    query and key/value ranks, the head sizes with and without RoPE) and RoPE with YaRN. `given` is not needed:
    every field maps one to one.

    Raises:
        ModelArgsError: a config these arguments cannot represent (key/value heads other than the heads, tied
            embeddings, biases, another activation or RoPE scaling, a YaRN mscale other than its mscale_all_dim).
    """
    c = {**_HF_DEFAULTS, **config}
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping):  # transformers >= 5 writes the base and the scaling together
        c["rope_theta"] = rope.get("rope_theta", c["rope_theta"])
        c["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else dict(rope)
    missing = [key for key in _SAME.values() if c.get(key) is None]
    if missing:
        raise ModelArgsError(f"config.json has no {', '.join(missing)}; use the model's own config.json")
    unsupported = [
        f"{key} {json.dumps(c[key])} (ours: {json.dumps(ours)})"
        for key, ours in (
            ("hidden_act", "silu"),
            ("attention_bias", False),
            ("tie_word_embeddings", False),
            ("scoring_func", "sigmoid"),
            ("num_key_value_heads", c["num_attention_heads"]),  # multi-head latent attention: one key per head
            ("rope_interleave", True),  # RoPE on adjacent channel pairs, as the weights were trained
        )
        if c.get(key, ours) != ours
    ]
    scaling = c["rope_scaling"]
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else None
    if kind not in (None, "yarn"):
        unsupported.append(f"rope_scaling of type {kind!r} (only 'yarn' is implemented)")
    elif kind == "yarn" and scaling.get("mscale", 1.0) != scaling.get("mscale_all_dim", 1.0):
        unsupported.append("a YaRN mscale other than its mscale_all_dim (one temperature coefficient here)")
    if unsupported:
        raise ModelArgsError(f"config.json has {', '.join(unsupported)}, which models/deepseek_v3 cannot represent")
    out: dict[str, Any] = {ours: c[key] for ours, key in _SAME.items()}
    out.update(
        norm_eps=float(out["norm_eps"]),
        rope_theta=float(out["rope_theta"]),
        route_scale=float(out["route_scale"]),
        route_norm=bool(out["route_norm"]),
        score_func="sigmoid",
        q_lora_rank=c["q_lora_rank"] or 0,  # None: no query compression
    )
    if kind == "yarn":
        out.update(
            original_seq_len=scaling["original_max_position_embeddings"],
            rope_factor=float(scaling["factor"]),
            beta_fast=scaling.get("beta_fast", ModelArgs.beta_fast),
            beta_slow=scaling.get("beta_slow", ModelArgs.beta_slow),
            mscale=float(scaling.get("mscale_all_dim", 1.0)),
        )
    else:  # no YaRN: the table covers the trained context as it is
        out["original_seq_len"] = out["max_seq_len"]
    return out


__all__ = ["args_from_hf_config"]
