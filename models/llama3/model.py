"""Llama 3, in one file you can read top to bottom.

Order follows the data: config, rotary frequencies, attention,
feed-forward, the transformer block, the model, then helpers that count
parameters and FLOPs.

Parameter names match Meta's checkpoints (`layers.0.attention.wq.weight`, ...);
the trainer relies on `model.layers` being the list of transformer blocks.

Big flavors are built without memory and materialized afterwards:

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.common.documents import attention_dtype, document_mask, document_positions
from models.common.norms import RMSNorm
from models.common.rope import RotaryEmbedding, apply_rotary
from models.common.spec import ModelArgsError, arg


@dataclass(frozen=True)
class ModelArgs:
    """Shape and initialization of a Llama-3 model. Frozen: derive variants with `dataclasses.replace`."""

    dim: int = arg(4096, "model width", ge=1)
    n_layers: int = arg(32, "number of transformer blocks", ge=1)
    n_heads: int = arg(32, "attention heads", ge=1)
    n_kv_heads: int | None = arg(None, "key/value heads (grouped-query attention); unset: n_heads", ge=1)
    vocab_size: int = arg(128256, "vocabulary size (must cover the tokenizer's ids)", ge=1)
    multiple_of: int = arg(256, "FFN hidden size is rounded up to a multiple of this", ge=1)
    ffn_dim_multiplier: float | None = arg(None, "FFN hidden size multiplier (of 2/3 of 4 x dim)", gt=0)
    norm_eps: float = arg(1e-5, "RMSNorm epsilon", gt=0)
    rope_theta: float = arg(500000.0, "RoPE base frequency", gt=0)
    # Llama-3.1 long-context frequency scaling of RoPE.
    use_rope_scaling: bool = arg(False, "apply Llama-3.1 RoPE frequency scaling")
    scaling_factor: float = arg(8.0, "RoPE scaling: how much the low frequencies are stretched", gt=0)
    low_freq_factor: float = arg(1.0, "RoPE scaling: low-frequency edge (original wavelengths per context)", gt=0)
    high_freq_factor: float = arg(4.0, "RoPE scaling: high-frequency edge (original wavelengths per context)", gt=0)
    original_max_seq_len: int = arg(8192, "RoPE scaling: the context length the model was first trained at", ge=1)
    max_seq_len: int = arg(2048, "longest sequence the RoPE table covers", ge=1)
    dropout: float = arg(0.0, "residual dropout probability; 0 disables it (no op in the graph)", ge=0, lt=1)
    tie_embeddings: bool = arg(False, "share the input embedding and output projection")
    depth_init: bool = arg(True, "scale output projections' init by layer depth rather than model depth")

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ModelArgsError(
                f"model dim {self.dim} is not divisible by n_heads {self.n_heads}; pick n_heads that divides dim"
            )
        if (self.dim // self.n_heads) % 2 != 0:
            raise ModelArgsError(
                f"head dim {self.dim // self.n_heads} is odd; RoPE needs an even head dim (change dim or n_heads)"
            )
        if self.n_heads % self.kv_heads != 0:
            raise ModelArgsError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}; "
                "pick n_kv_heads that divides n_heads"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ModelArgsError(f"dropout {self.dropout} is outside [0, 1); set model dropout to e.g. 0.0 or 0.1")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


# --------------------------------------------------------------------------- rotary embeddings
# RMSNorm, the cos/sin tables and the rotation itself are shared by the families: models/common/.


def rope_frequencies(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotation frequency of each pair of channels in a head: theta^(-2i/head_dim), shape [head_dim // 2].

    With `use_rope_scaling` the Llama-3.1 rule stretches the low frequencies (long
    wavelengths) by `scaling_factor`, keeps the high ones, and blends in between.
    """
    exponents = torch.arange(0, args.head_dim, 2, device=device, dtype=torch.float32) / args.head_dim
    freqs = 1.0 / (args.rope_theta**exponents)
    if not args.use_rope_scaling:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = args.original_max_seq_len / args.low_freq_factor
    high_freq_wavelen = args.original_max_seq_len / args.high_freq_factor
    # 0 at the low-frequency edge, 1 at the high-frequency edge.
    smooth = (args.original_max_seq_len / wavelen - args.low_freq_factor) / (
        args.high_freq_factor - args.low_freq_factor
    )
    blended = (1 - smooth) * freqs / args.scaling_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / args.scaling_factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rotary_embedding(args: ModelArgs) -> RotaryEmbedding:
    """The cos/sin tables of `rope_frequencies`; the tables and `apply_rotary` are in models/common/rope.py."""
    return RotaryEmbedding(args.max_seq_len, args.head_dim // 2, functools.partial(rope_frequencies, args))


# --------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; with a document mask, causal within each packed document."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim]; `mask` is the additive [B, 1, S, S] mask of `document_mask` (None: causal)."""
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, head_dim]
        # Share each KV head with its group of query heads explicitly: SDPA's own
        # `enable_gqa` path would not reach the fused CPU flash kernel.
        k, v = self._expand_kv(k), self._expand_kv(v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep == 1:
            return t
        bsz, n_kv, seq_len, head_dim = t.shape
        return t[:, :, None].expand(bsz, n_kv, n_rep, seq_len, head_dim).reshape(bsz, n_kv * n_rep, seq_len, head_dim)


# --------------------------------------------------------------------------- feed-forward


def ffn_hidden_dim(args: ModelArgs) -> int:
    """Llama-3 SwiGLU width: 2/3 of 4*dim (keeps the FLOPs of a 4*dim GELU MLP), scaled, rounded up."""
    hidden = 4 * args.dim
    hidden = int(2 * hidden / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hidden = ffn_hidden_dim(args)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# --------------------------------------------------------------------------- transformer block


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.args = args
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self._dropout(self.attention(self.attention_norm(x), cos, sin, mask))
        return h + self._dropout(self.feed_forward(self.ffn_norm(h)))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Skipped entirely at p=0 so the graph has no random op to save or replay.
        if self.args.dropout == 0.0:
            return x
        return F.dropout(x, p=self.args.dropout, training=self.training)

    def init_weights(self) -> None:
        """Inputs projections std 0.02; output projections scaled down with depth (see ModelArgs.depth_init)."""
        depth = self.layer_id + 1 if self.args.depth_init else self.args.n_layers
        out_std = 0.02 / math.sqrt(2 * depth)
        for linear in (self.attention.wq, self.attention.wk, self.attention.wv, self.feed_forward.w1):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        for linear in (self.attention.wo, self.feed_forward.w2, self.feed_forward.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


# --------------------------------------------------------------------------- the model


class Transformer(nn.Module):
    """Llama 3: token embedding, n_layers blocks, final norm, output projection to logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = rotary_embedding(args)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens LongTensor [B, S] -> logits [B, S, vocab_size] in the model's dtype.

        `document_ids` [B, S] (see models/common/documents.py) keeps packed documents apart: each attends only
        within itself and its RoPE positions restart at 0. None: one causal sequence per row.
        """
        return self.output(self.hidden_states(tokens, document_ids))

    def hidden_states(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] -> the normalized last hidden states [B, S, dim] that `output` projects to logits.

        A chunked loss (graph_trainer.loss.chunked_lm_loss) projects them chunk by chunk.
        """
        positions = None if document_ids is None else document_positions(document_ids)
        cos, sin = self.rope(tokens.shape[1], positions)
        h = self.tok_embeddings(tokens)
        mask = None if document_ids is None else document_mask(document_ids, attention_dtype(h))
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)

    def init_buffers(self) -> None:
        """(Re)compute the buffers derived from the config (the RoPE tables): what pretrained weights, which hold
        only parameters, leave to compute."""
        self.rope.reset_parameters()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter and the RoPE tables in place; deterministic under torch.manual_seed.

        A no-op for tensors on the meta device (a meta model has no values to set);
        call it after `to_empty()`, which also restores the embedding tie that
        `to_empty()` breaks.
        """
        if self.args.tie_embeddings:
            # `to_empty()` gives each module its own new Parameter, which unties them.
            self.output.weight = self.tok_embeddings.weight
        if self.output.weight.device.type == "meta":
            return
        self.init_buffers()
        if not self.args.tie_embeddings:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        # When tied this also sets the embedding: the output role decides the
        # scale, because std 1.0 would make the first logits ~sqrt(dim) large.
        std = self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


# --------------------------------------------------------------------------- helpers


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of parameters, tied weights counted once (meta tensors count too).

    `exclude_embedding` leaves out the token embedding table (and with it a
    tied output projection, which is the same tensor).
    """
    excluded: set[int] = set()
    if exclude_embedding:
        excluded = {id(p) for p in model.tok_embeddings.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in excluded)


def num_params_from_args(args: ModelArgs) -> int:
    """Parameter count of `Transformer(args)` derived from the config alone (tied weights once)."""
    kv_dim = args.kv_heads * args.head_dim
    attention = 2 * args.dim * args.dim + 2 * args.dim * kv_dim
    ffn = 3 * args.dim * ffn_hidden_dim(args)
    per_layer = attention + ffn + 2 * args.dim  # + two RMSNorm weights
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return embedding + args.n_layers * per_layer + args.dim + output


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6*N + 12*n_layers*n_heads*head_dim*seq_len.

    N counts the parameters that take part in a matmul: everything but the
    embedding lookup, with the output projection counted even when tied (its
    matmul runs either way). The second term is the attention score and value
    matmuls (forward + backward), which have no parameters.
    """
    n_matmul = num_params_from_args(args) - args.vocab_size * args.dim
    if args.tie_embeddings:
        n_matmul += args.vocab_size * args.dim
    return 6.0 * n_matmul + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
