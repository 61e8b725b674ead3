"""Hugging Face DeepSeek-V3 weights <-> ours: parameter names, the experts' layout, the router bias, `config.json`.

Plain PyTorch, as models/llama3/state_dict_adapter.py: the trainer reads and writes the files
(graph_trainer/checkpoint/hf.py); this module only knows the two layouts.

- **Names.** `model.layers.{i}.self_attn.q_a_proj.weight` is our `layers.{i}.attention.wq_a.weight`, and so on
  (`_LAYER_NAMES`, `TOP_NAMES`): multi-head latent attention's projections and norms, the dense layers' MLP,
  the shared experts and the router's gate.
- **Routed experts.** Hugging Face writes one tensor per expert and projection, `mlp.experts.{e}.gate_proj.weight`
  [hidden, dim] (as `nn.Linear` stores it). Ours stacks the experts for grouped matmuls: `moe.experts.w1`
  [experts, dim, hidden], so our `w1[e]` is the transpose of expert e's `gate_proj`; `w3` is `up_proj`, `w2`
  `down_proj`. A rank that holds a block of experts reads only those experts' tensors.
- **The router bias.** DeepSeek-V3's auxiliary-loss-free balancing bias is Hugging Face's
  `mlp.gate.e_score_correction_bias`, our buffer `moe.router.expert_bias`: loaded and exported with the weights,
  since it decides which experts a token goes to. `tokens_per_expert` (a statistic) is not in the files.
- **RoPE.** No permutation: transformers' DeepSeek-V3 rotates adjacent channel pairs of the decoupled RoPE head
  (`rope_interleave = true`, its default and the published checkpoints' layout), as ours does. A folder with
  `rope_interleave = false` is refused by `hf_config.args_from_hf_config`.
- **Multi-token prediction.** The published checkpoints hold one more layer (`num_nextn_predict_layers`) that
  predicts a second token; transformers skips it and so do we (`ignorable`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from models.common.hf_names import HF_LAYER, OURS_LAYER, TOP_NAMES, ConfigMismatch, same_value
from models.deepseek_v3.hf_config import _SAME, args_from_hf_config
from models.deepseek_v3.model import ModelArgs

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",  # q_lora_rank = 0: no query compression
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
_EXPERT_PROJECTIONS = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
_BUFFERS = ("moe.router.expert_bias",)  # buffers the files hold (the rest are computed or statistics)


class DeepSeekV3StateDictAdapter:
    """Names, layouts and config of Hugging Face's `DeepseekV3ForCausalLM` for `DeepSeekV3(args)`."""

    def __init__(self, args: ModelArgs):
        self.args = args

    # --- names ----------------------------------------------------------------------------------------

    def hf_names(self, name: str) -> list[str]:
        """The Hugging Face tensors that hold our `name`: one, or one per expert for the stacked experts (in
        expert order). KeyError for a name DeepSeek-V3 does not have."""
        m = OURS_LAYER.match(name)
        if m is None:
            return [TOP_NAMES[name]]
        layer, rest = m.groups()
        if rest in _EXPERT_PROJECTIONS:
            projection = _EXPERT_PROJECTIONS[rest]
            return [
                f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight" for e in range(self.args.n_routed_experts)
            ]
        return [f"model.layers.{layer}.{_LAYER_NAMES[rest]}"]

    def our_name(self, hf_name: str) -> str | None:
        """Our name of the tensor (or the stacked experts) that holds Hugging Face's `hf_name`; None when our model
        has no such tensor."""
        m = HF_LAYER.match(hf_name)
        if m is None:
            return {v: k for k, v in TOP_NAMES.items()}.get(hf_name)
        layer, rest = m.groups()
        expert = _HF_EXPERT.match(rest)
        if expert:
            ours = {v: k for k, v in _EXPERT_PROJECTIONS.items()}[expert.group(2)]
            return f"layers.{layer}.{ours}"
        ours = {v: k for k, v in _LAYER_NAMES.items()}.get(rest)
        return f"layers.{layer}.{ours}" if ours else None

    def ignorable(self, hf_name: str) -> bool:
        """A tensor of the published folders that the model rightly has no place for: the multi-token-prediction
        layers after the last one (`num_nextn_predict_layers`), which transformers skips too."""
        m = HF_LAYER.match(hf_name)
        return m is not None and int(m.group(1)) >= self.args.n_layers

    def is_stacked(self, name: str) -> bool:
        """Whether our `name` stacks the experts: [experts, in, out], expert e the transpose of its own tensor."""
        m = OURS_LAYER.match(name)
        return m is not None and m.group(2) in _EXPERT_PROJECTIONS

    def buffers(self, names: list[str]) -> list[str]:
        """Which of the model's buffer `names` the files hold (the router biases)."""
        return [n for n in names if n.endswith(_BUFFERS)]

    def in_hf_files(self, name: str) -> bool:
        """Whether Hugging Face's files hold our `name` (every parameter; of the buffers, the router biases)."""
        return not name.endswith(("tokens_per_expert", "step_counts"))

    def export_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype `name` is exported in: float32 for the router's gate and bias, which transformers keeps in
        float32 whatever the model's dtype (`_keep_in_fp32_modules_strict`); the export's for the rest."""
        return torch.float32 if ".moe.router." in name else dtype

    # --- layouts --------------------------------------------------------------------------------------

    def rows_read_together(self, name: str) -> int:
        """The row block the conversion of `name` works on: one row (nothing permutes rows)."""
        return 1

    def from_hf_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows of Hugging Face's tensor for our `name`, in our layout: the same (see the module doc on RoPE)."""
        return rows

    def to_hf_tensors(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Our whole tensor `name` as Hugging Face's tensors (contiguous, ready for a safetensors file); {} for a
        tensor the files do not hold."""
        if not self.in_hf_files(name):
            return {}
        hf_names = self.hf_names(name)
        if self.is_stacked(name):
            return {n: tensor[e].t().contiguous() for e, n in enumerate(hf_names)}
        return {hf_names[0]: tensor.contiguous()}

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our whole state dict (parameters and persistent buffers) -> Hugging Face's."""
        return {k: v for name, t in state.items() for k, v in self.to_hf_tensors(name, t).items()}

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face's state dict -> ours (the experts stacked; the multi-token-prediction layers left out)."""
        experts: dict[str, dict[int, torch.Tensor]] = {}
        out: dict[str, torch.Tensor] = {}
        for hf_name, tensor in state.items():
            if self.ignorable(hf_name):
                continue
            name = self.our_name(hf_name)
            if name is None:
                raise KeyError(f"{hf_name} has no place in DeepSeek-V3 with {self.args}")
            if self.is_stacked(name):
                expert = int(_HF_EXPERT.match(HF_LAYER.match(hf_name).group(2)).group(1))
                experts.setdefault(name, {})[expert] = tensor.t()
            else:
                out[name] = tensor
        for name, by_expert in experts.items():
            out[name] = torch.stack([by_expert[e] for e in range(self.args.n_routed_experts)])
        return out

    # --- config.json ----------------------------------------------------------------------------------

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The `config.json` of these arguments, as `transformers.DeepseekV3Config` reads it."""
        a = self.args
        config: dict[str, Any] = {key: getattr(a, ours) for ours, key in _SAME.items()}
        yarn = a.max_seq_len > a.original_seq_len
        config.update(
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            num_key_value_heads=a.n_heads,
            q_lora_rank=a.q_lora_rank or None,
            head_dim=a.qk_rope_head_dim,
            rope_interleave=True,
            rope_scaling=(
                {
                    "rope_type": "yarn",
                    "factor": a.rope_factor,
                    "original_max_position_embeddings": a.original_seq_len,
                    "beta_fast": a.beta_fast,
                    "beta_slow": a.beta_slow,
                    "mscale": a.mscale,
                    "mscale_all_dim": a.mscale,
                }
                if yarn
                else None
            ),
            tie_word_embeddings=False,
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            num_nextn_predict_layers=0,
            torch_dtype=str(dtype).removeprefix("torch."),
        )
        return config

    def config_mismatch(self, config: Mapping[str, Any]) -> ConfigMismatch | None:
        """The first field of a Hugging Face `config.json` that disagrees with the model arguments, or None (the
        fields `hf_config.args_from_hf_config` reads, in its order)."""
        if config.get("model_type") != "deepseek_v3":
            return ConfigMismatch("model_type", config.get("model_type"), "deepseek_v3", "model.name")
        found = args_from_hf_config(config, {})
        for ours, value in found.items():
            expected = getattr(self.args, ours)
            if not same_value(value, expected):
                key = _SAME.get(ours, ours)
                return ConfigMismatch(key, config.get(key, value), expected, f"model.{ours}")
        return None


__all__ = ["DeepSeekV3StateDictAdapter"]
