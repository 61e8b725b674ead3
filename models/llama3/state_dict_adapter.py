"""Hugging Face Llama weights <-> ours: parameter names, the q/k RoPE layout, and `config.json`.

Plain PyTorch: the trainer reads the files (graph_trainer/checkpoint/hf.py); this module only knows the
two layouts.

Names: `model.layers.{i}.self_attn.q_proj.weight` is our `layers.{i}.attention.wq.weight`, and so on
(`_LAYER_NAMES`, `TOP_NAMES`).

RoPE: we rotate adjacent channel pairs (x[2i], x[2i+1]) of each head (Meta's layout, see
models/common/rope.py); Hugging Face rotates the two halves of a head (x[i], x[i + head_dim/2])
("rotate_half"). The same rotation, applied to differently ordered channels: permuting the rows of wq and
wk within each head turns one layout into the other. Our row 2i + c of a head is Hugging Face's row
c * head_dim/2 + i. The permutation stays within a head, so it applies to any block of whole heads (an
FSDP rank converts only the heads its shard touches).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from models.common.hf_names import HF_LAYER, OURS_LAYER, TOP_NAMES, ConfigMismatch, same_value
from models.common.spec import ModelArgsError
from models.llama3.model import ModelArgs, ffn_hidden_dim

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_ROTATED = ("attention.wq.weight", "attention.wk.weight")  # the projections RoPE rotates: their rows permute


def interleaved_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads in our pair layout (2i + c) -> Hugging Face's half layout (c * head_dim/2 + i)."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def halves_to_interleaved(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads in Hugging Face's half layout -> our pair layout (the inverse of the above)."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


class Llama3StateDictAdapter:
    """Names, layouts and config of Hugging Face's `LlamaForCausalLM` for `Transformer(args)`."""

    def __init__(self, args: ModelArgs):
        self.args = args

    # --- names ----------------------------------------------------------------------------------------

    def hf_name(self, name: str) -> str:
        """Hugging Face's name of our parameter `name`. KeyError for a name Llama does not have."""
        m = OURS_LAYER.match(name)
        if m:
            return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        return TOP_NAMES[name]

    def our_name(self, hf_name: str) -> str | None:
        """Our name of Hugging Face's tensor `hf_name`; None when our model has no such tensor."""
        m = HF_LAYER.match(hf_name)
        if m:
            ours = {v: k for k, v in _LAYER_NAMES.items()}.get(m.group(2))
            return f"layers.{m.group(1)}.{ours}" if ours else None
        return {v: k for k, v in TOP_NAMES.items()}.get(hf_name)

    def hf_names(self, name: str) -> list[str]:
        """The Hugging Face tensors that hold our `name`: always the one (`hf_name`)."""
        return [self.hf_name(name)]

    def in_hf_files(self, name: str) -> bool:
        """Whether Hugging Face's files hold our parameter `name`: a tied output projection is not written (it is
        the embedding, as `tie_word_embeddings` says)."""
        return not (self.args.tie_embeddings and name == "output.weight")

    def ignorable(self, hf_name: str) -> bool:
        """A tensor of the folder that the model has no place for and may skip: none of Llama's."""
        return False

    def is_stacked(self, name: str) -> bool:
        """Whether our `name` stacks several Hugging Face tensors: never, in Llama."""
        return False

    def buffers(self, names: list[str]) -> list[str]:
        """Which of the model's buffer `names` the files hold: none (the RoPE tables come from the config)."""
        return []

    def export_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype `name` is exported in: the export's, for every tensor."""
        return dtype

    # --- layouts --------------------------------------------------------------------------------------

    def rows_read_together(self, name: str) -> int:
        """The row block the conversion of `name` works on: a head for wq and wk (their rows permute within a
        head), else one row. A partial read of `name` must cover whole blocks."""
        return self.args.head_dim if name.endswith(_ROTATED) else 1

    def from_hf_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows of Hugging Face's tensor for our `name` (whole blocks of `rows_read_together`) in our layout."""
        return halves_to_interleaved(rows, self.args.head_dim) if name.endswith(_ROTATED) else rows

    def to_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our whole tensor `name` in Hugging Face's layout (contiguous, ready for a safetensors file)."""
        if name.endswith(_ROTATED):
            return interleaved_to_halves(tensor, self.args.head_dim).contiguous()
        return tensor.contiguous()

    def to_hf_tensors(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Our whole tensor `name` as Hugging Face's tensors: {its name: it}, or {} for a tied output projection."""
        return {self.hf_name(name): self.to_hf_tensor(name, tensor)} if self.in_hf_files(name) else {}

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our whole state dict -> Hugging Face's (names, q/k layout; a tied output projection left out)."""
        return {self.hf_name(k): self.to_hf_tensor(k, v) for k, v in state.items() if self.in_hf_files(k)}

    def from_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face's state dict -> ours (a tied output projection is the embedding, as in our model)."""
        out = {}
        for hf_name, tensor in state.items():
            name = self.our_name(hf_name)
            if name is None or not self.in_hf_files(name):
                raise KeyError(f"{hf_name} has no place in Llama-3 with {self.args}")
            out[name] = self.from_hf_rows(name, tensor)
        if self.args.tie_embeddings:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    # --- config.json ----------------------------------------------------------------------------------

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The `config.json` of these arguments, as `transformers.LlamaConfig` reads it."""
        a = self.args
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "intermediate_size": ffn_hidden_dim(a),
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": self._rope_scaling(),
            # transformers expects the longest context at least the length RoPE scaling stretched from.
            "max_position_embeddings": max(a.max_seq_len, a.original_max_seq_len if a.use_rope_scaling else 0),
            "tie_word_embeddings": a.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    def _rope_scaling(self) -> dict[str, Any] | None:
        a = self.args
        if not a.use_rope_scaling:
            return None
        return {
            "rope_type": "llama3",
            "factor": a.scaling_factor,
            "low_freq_factor": a.low_freq_factor,
            "high_freq_factor": a.high_freq_factor,
            "original_max_position_embeddings": a.original_max_seq_len,
        }

    def config_mismatch(self, config: Mapping[str, Any]) -> ConfigMismatch | None:
        """The first field of a Hugging Face `config.json` that disagrees with the model arguments, or None.

        Compared: the architecture, every shape (width, layers, heads, kv heads, head dim, vocabulary, FFN
        width), the RoPE base and scaling, tied embeddings, the norm epsilon, and the absence of biases.
        """
        ours = self.hf_config()
        found = _normalized(config)
        for field_name, option in _CHECKED:
            if not same_value(found.get(field_name), ours[field_name]):
                return ConfigMismatch(field_name, found[field_name], ours[field_name], option)
        return None


# config.json field -> the option (`--model.X`, or what sets it) that must agree with it; checked in this order.
_CHECKED: tuple[tuple[str, str], ...] = (
    ("model_type", "model.name (only 'llama' loads into llama3)"),
    ("hidden_size", "model.dim"),
    ("num_hidden_layers", "model.n_layers"),
    ("num_attention_heads", "model.n_heads"),
    ("num_key_value_heads", "model.n_kv_heads"),
    ("head_dim", "model.dim / model.n_heads"),
    ("vocab_size", "model.vocab_size"),
    ("intermediate_size", "model.ffn_dim_multiplier and model.multiple_of"),
    ("rope_theta", "model.rope_theta"),
    ("rope_scaling", "model.use_rope_scaling and the flavor's RoPE scaling"),
    ("tie_word_embeddings", "model.tie_embeddings"),
    ("rms_norm_eps", "model.norm_eps"),
    ("hidden_act", "nothing: Llama-3 uses silu"),
    ("attention_bias", "nothing: Llama-3 has no biases"),
    ("mlp_bias", "nothing: Llama-3 has no biases"),
)


# What `transformers.LlamaConfig` assumes for a field a config.json leaves out.
_HF_DEFAULTS = {
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def _normalized(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with Hugging Face's defaults and spellings made explicit: a missing `num_key_value_heads` is
    `num_attention_heads`, a missing `head_dim` is the width over the heads, newer files keep RoPE under
    `rope_parameters`, and a "default" RoPE is no scaling."""
    out = {**_HF_DEFAULTS, **config}
    out.setdefault("num_key_value_heads", out.get("num_attention_heads"))
    if out.get("head_dim") is None and out.get("hidden_size") and out.get("num_attention_heads"):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping):  # transformers >= 5 writes the base and the scaling together
        out["rope_theta"] = rope.get("rope_theta", out["rope_theta"])
        out["rope_scaling"] = dict(rope)
    scaling = out["rope_scaling"]
    if isinstance(scaling, Mapping):
        kind = scaling.get("rope_type", scaling.get("type"))
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        out["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **{k: scaling.get(k) for k in keys}}
    return out


def args_from_hf_config(config: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The `ModelArgs` fields a Hugging Face Llama `config.json` sets: the folder alone is the model.

    Every field the file decides (width, depth, heads, KV heads, vocabulary, FFN width, RoPE base and llama3
    scaling, norm epsilon, tied embeddings, the longest context). The FFN width `intermediate_size` maps exactly
    onto our rule (`ffn_hidden_dim`): the given `multiple_of` / `ffn_dim_multiplier` when they already give it,
    else `multiple_of` = the width itself and a multiplier that rounds up to it.

    Raises:
        ModelArgsError: a config these arguments cannot represent (a head size other than width / heads, another
            activation, biases, another RoPE scaling, an FFN width our rule cannot give), in one line.
    """
    c = _normalized(config)
    dim, heads = c.get("hidden_size"), c.get("num_attention_heads")
    if not isinstance(dim, int) or not isinstance(heads, int) or heads < 1:
        raise ModelArgsError("config.json has no integer hidden_size and num_attention_heads; use the model's own")
    unsupported = [
        f"{key} {json.dumps(c[key])} (Llama-3 has {json.dumps(ours)})"
        for key, ours in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
        if c.get(key) != ours
    ]
    if c.get("head_dim") != dim // heads:
        unsupported.append(f"head_dim {c.get('head_dim')} (this model's is hidden_size / num_attention_heads)")
    scaling = c["rope_scaling"]
    if scaling is not None and scaling.get("rope_type") != "llama3":
        unsupported.append(f"rope_scaling of type {scaling.get('rope_type')!r} (only 'llama3' is implemented)")
    if unsupported:
        raise ModelArgsError(f"config.json has {', '.join(unsupported)}, which models/llama3 cannot represent")
    out: dict[str, Any] = {
        "dim": dim,
        "n_layers": c["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": c["num_key_value_heads"],
        "vocab_size": c["vocab_size"],
        "norm_eps": float(c["rms_norm_eps"]),
        "rope_theta": float(c["rope_theta"]),
        "use_rope_scaling": scaling is not None,
        "tie_embeddings": bool(c["tie_word_embeddings"]),
        "max_seq_len": c.get("max_position_embeddings", ModelArgs.max_seq_len),
        **_ffn_fields(dim, c["intermediate_size"], given),
    }
    if scaling is not None:
        out.update(
            scaling_factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_seq_len=scaling["original_max_position_embeddings"],
        )
    return out


def _ffn_fields(dim: int, width: int, given: Mapping[str, Any]) -> dict[str, Any]:
    """`multiple_of` and `ffn_dim_multiplier` that give the FFN width `width` at model width `dim`: the given ones
    when they do, else `width` itself and a multiplier that lands in (width - multiple_of, width]. Never a None
    multiplier (None is "the flavor's value" on the command line; 1.0 is the same rule)."""
    for multiple_of, multiplier in (
        (given.get("multiple_of") or ModelArgs.multiple_of, given.get("ffn_dim_multiplier") or 1.0),
        (width, width / int(8 * dim / 3)),
    ):
        args = ModelArgs(dim=dim, n_heads=1, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
        if ffn_hidden_dim(args) == width:
            return {"multiple_of": multiple_of, "ffn_dim_multiplier": multiplier}
    raise ModelArgsError(
        f"config.json's intermediate_size {width} cannot be given by the FFN rule of models/llama3 at hidden_size "
        f"{dim}; set --model.multiple_of and --model.ffn_dim_multiplier that give it"
    )


__all__ = [
    "ConfigMismatch",
    "args_from_hf_config",
    "Llama3StateDictAdapter",
    "halves_to_interleaved",
    "interleaved_to_halves",
]
