"""DeepSeek-V3, in one file you can read top to bottom.

Order follows the data: config, rotary frequencies (YaRN), multi-head latent attention, the dense
feed-forward, the router with its load-balancing bias, the routed experts, the MoE layer, the
transformer block, the model, then helpers that count parameters and FLOPs.

What makes it traceable as one static graph (graph_trainer traces the whole step with make_fx on fake
tensors): routing is dropless and static. Every token's top-k choices become a buffer of exactly
`tokens x top_k` rows, sorted by expert; the number of rows per expert exists only as tensor data (the
offsets `torch._grouped_mm` reads), never as a Python number. No `.item()`, no `nonzero`, no host sync.

Load balancing is DeepSeek-V3's auxiliary-loss-free rule: each router keeps a per-expert bias that is added
to the scores for *selection only* (the gate weights come from the unbiased scores), and after each step
the bias moves by `bias_update_rate` toward the under-loaded experts: bias += rate * sign(mean - count).
The counts and the bias are buffers, written in place under no_grad, outside the gradient. Each training
forward adds its counts to `step_counts`; once per step, after the gradients (every micro-batch's, with
gradient accumulation), `rebalance` moves the bias from them (summed over the data-parallel ranks first) and
clears them. The trainer traces that update into the graph that holds the step's update, so the whole rule
lives inside the step; between steps the only state is the bias (equal on every rank), which a checkpoint
resumes bitwise.

Big flavors are built without memory and materialized afterwards:

    with torch.device("meta"):
        model = DeepSeekV3(args)
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

SCORE_FUNCTIONS = ("sigmoid", "softmax")
# torch._grouped_mm needs every row stride to be a multiple of 16 bytes: widths a multiple of 8 cover bf16.
GROUPED_MM_ALIGN = 8


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a DeepSeek-V3 model. Frozen: derive variants with `dataclasses.replace`."""

    dim: int = arg(7168, "model width", ge=1)
    n_layers: int = arg(61, "number of transformer blocks", ge=1)
    n_dense_layers: int = arg(3, "the first blocks use a dense FFN, the rest a mixture of experts", ge=0)
    n_heads: int = arg(128, "attention heads", ge=1)
    vocab_size: int = arg(129280, "vocabulary size (must cover the tokenizer's ids)", ge=1)
    inter_dim: int = arg(18432, "dense FFN hidden size", ge=1)
    moe_inter_dim: int = arg(2048, "hidden size of one expert (routed or shared)", ge=1)
    # Mixture of experts.
    n_routed_experts: int = arg(256, "routed experts per MoE block", ge=1)
    n_shared_experts: int = arg(1, "shared experts per MoE block (every token runs them)", ge=0)
    n_activated_experts: int = arg(8, "routed experts per token (top-k)", ge=1)
    n_expert_groups: int = arg(1, "> 1: group-limited routing, the experts split into this many groups", ge=1)
    n_limited_groups: int = arg(1, "group-limited routing: a token picks its experts from this many groups", ge=1)
    score_func: str = arg("sigmoid", "router scores", choices=SCORE_FUNCTIONS)
    route_norm: bool = arg(True, "renormalize the top-k gate weights to sum to 1")
    route_scale: float = arg(1.0, "factor on the routed experts' gate weights", gt=0)
    bias_update_rate: float = arg(0.001, "the balancing bias's step per training step (gamma); 0 freezes it", ge=0)
    # Multi-head latent attention.
    q_lora_rank: int = arg(0, "rank of the query compression; 0: no query compression", ge=0)
    kv_lora_rank: int = arg(512, "rank of the key/value compression", ge=1)
    qk_nope_head_dim: int = arg(128, "query/key channels per head without RoPE", ge=1)
    qk_rope_head_dim: int = arg(64, "query/key channels per head with RoPE (decoupled)", ge=2)
    v_head_dim: int = arg(128, "value channels per head", ge=1)
    # RoPE with YaRN scaling once max_seq_len exceeds original_seq_len.
    rope_theta: float = arg(10000.0, "RoPE base frequency", gt=0)
    max_seq_len: int = arg(4096, "longest sequence the RoPE table covers", ge=1)
    original_seq_len: int = arg(4096, "YaRN: the context length the model was first trained at", ge=1)
    rope_factor: float = arg(40.0, "YaRN: context extension factor (applied when max_seq_len > original_seq_len)", gt=0)
    beta_fast: int = arg(32, "YaRN: rotations at the high-frequency edge of the ramp", ge=1)
    beta_slow: int = arg(1, "YaRN: rotations at the low-frequency edge of the ramp", ge=1)
    mscale: float = arg(1.0, "YaRN: attention temperature coefficient", gt=0)
    norm_eps: float = arg(1e-6, "RMSNorm epsilon", gt=0)

    def __post_init__(self) -> None:
        checks = (
            (self.score_func in SCORE_FUNCTIONS, f"score_func {self.score_func!r} is not one of {SCORE_FUNCTIONS}"),
            (0 <= self.n_dense_layers <= self.n_layers, "n_dense_layers must be between 0 and n_layers"),
            (
                1 <= self.n_activated_experts <= self.n_routed_experts,
                f"n_activated_experts {self.n_activated_experts} must be between 1 and n_routed_experts "
                f"{self.n_routed_experts}",
            ),
            (
                self.n_routed_experts % self.n_expert_groups == 0,
                f"n_expert_groups {self.n_expert_groups} must divide n_routed_experts {self.n_routed_experts}",
            ),
            (
                1 <= self.n_limited_groups <= self.n_expert_groups,
                f"n_limited_groups {self.n_limited_groups} must be between 1 and n_expert_groups",
            ),
            (
                self.n_limited_groups * self.n_routed_experts // self.n_expert_groups >= self.n_activated_experts,
                "the limited groups hold fewer experts than n_activated_experts; raise n_limited_groups",
            ),
            (self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (RoPE pairs)"),
            (
                self.dim % GROUPED_MM_ALIGN == 0 and self.moe_inter_dim % GROUPED_MM_ALIGN == 0,
                f"dim {self.dim} and moe_inter_dim {self.moe_inter_dim} must be multiples of {GROUPED_MM_ALIGN} "
                "(torch._grouped_mm needs 16-byte row strides)",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ModelArgsError(f"{message}; change the model arguments")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers


# --------------------------------------------------------------------------- rotary embeddings (YaRN)


def _yarn_ramp(args: ModelArgs, pairs: int) -> torch.Tensor:
    """Per pair: 0 where the wavelength is long (interpolate fully), 1 where it is short (keep), linear between.

    The edges are the pairs that rotate `beta_slow` and `beta_fast` times over the original context.
    """
    dim = args.qk_rope_head_dim

    def pair_rotating(n_rotations: float) -> float:
        return dim * math.log(args.original_seq_len / (n_rotations * 2 * math.pi)) / (2 * math.log(args.rope_theta))

    low = max(math.floor(pair_rotating(args.beta_fast)), 0)
    high = min(math.ceil(pair_rotating(args.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high  # a zero-width ramp would divide by zero
    return 1 - ((torch.arange(pairs, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def rope_frequencies(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """theta^(-2i/d) for the decoupled RoPE channels; YaRN-interpolated when max_seq_len > original_seq_len."""
    dim = args.qk_rope_head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if args.max_seq_len > args.original_seq_len:
        keep = _yarn_ramp(args, dim // 2)
        freqs = freqs / args.rope_factor * (1 - keep) + freqs * keep
    return freqs.to(device)


def softmax_scale(args: ModelArgs) -> float:
    """1/sqrt(qk_head_dim), times YaRN's attention temperature when the context is extended."""
    scale = args.qk_head_dim**-0.5
    if args.max_seq_len > args.original_seq_len:
        mscale = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
        scale = scale * mscale * mscale
    return scale


# --------------------------------------------------------------------------- multi-head latent attention


class Attention(nn.Module):
    """Multi-head latent attention: keys and values come from one low-rank latent per token.

    kv: x -> [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]; the normed latent expands to per-head
    k_nope and v; one RoPE key head is shared by all heads (decoupled RoPE). q: x -> per-head
    [q_nope | q_rope], through a low-rank bottleneck when q_lora_rank > 0.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.scale = softmax_scale(args)
        q_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim]; `mask` is the additive [B, 1, S, S] mask of `document_mask` (None: causal)."""
        bsz, seq_len, _ = x.shape
        # kv first: the compressed latent is the layer's first matmul, which selective AC saves.
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(2), cos, sin)  # one RoPE head, shared by every head
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq_len, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.n_heads, -1)], dim=-1)

        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(bsz, seq_len, self.n_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary(q_rope, cos, sin)], dim=-1)

        # SDPA's fused kernels want one head dim for q, k and v: pad v, drop the padding after.
        v = F.pad(v, (0, q.shape[-1] - self.v_dim)) if self.v_dim < q.shape[-1] else v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        out = out[..., : self.v_dim]
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def projections(self) -> list[nn.Linear]:
        return [m for m in self.children() if isinstance(m, nn.Linear)]


# --------------------------------------------------------------------------- feed-forward


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); the dense layers' FFN and the shared experts (all of them as one)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# --------------------------------------------------------------------------- router and load balancing


def recomputed_in_backward() -> bool:
    """True while autograd runs a backward, e.g. when torch.utils.checkpoint re-runs a layer's forward.

    The balancing buffers must be written once per step: a checkpointed layer re-runs its forward in the
    backward (as BatchNorm's running statistics would be updated twice). A traced step never re-runs Python:
    its recomputation is ops in the graph, and the passes keep in-place writes out of it.
    """
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """Top-k expert choice per token, with DeepSeek-V3's auxiliary-loss-free balancing bias.

    Buffers (fp32): `expert_bias` shifts the scores used to *select* experts (persistent: the state a resume
    needs); `step_counts` adds up this rank's (token, choice) pairs per expert over the step's training forwards
    (not persistent: `rebalance_` clears it at every step's end, so between steps it is zero); `tokens_per_expert`
    holds the last step's counts summed over the data-parallel ranks, the ones the bias moved by (persistent but
    only logged; equal on every rank). Counts are exact in fp32 up to 2^24 pairs per expert and step.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.n_activated_experts
        self.n_groups, self.n_limited_groups = args.n_expert_groups, args.n_limited_groups
        self.score_func, self.route_norm, self.route_scale = args.score_func, args.route_norm, args.route_scale
        self.bias_update_rate = args.bias_update_rate
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_routed_experts, dtype=torch.float32))
        self.register_buffer("step_counts", torch.zeros(args.n_routed_experts, dtype=torch.float32), persistent=False)
        # Set by a parallelism whose ranks route different tokens: sums the counts over them, so that the
        # bias stays equal on every rank. None: this process sees every token.
        self.count_reduce = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (gate weights [T, top_k] in x's dtype, expert ids [T, top_k] int64)."""
        logits = self.gate(x).float()
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        selection = scores + self.expert_bias  # the bias picks experts; it never weighs them
        if self.n_groups > 1:
            selection = self._limit_groups(selection)
        experts = selection.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.route_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.route_scale).type_as(x), experts

    def _limit_groups(self, selection: torch.Tensor) -> torch.Tensor:
        """Keep the experts of each token's best `n_limited_groups` groups; the others can no longer be chosen.

        A group's score is the sum of its two best experts (sigmoid, as DeepSeek-V3) or its best one (softmax).
        """
        grouped = selection.unflatten(-1, (self.n_groups, -1))
        if self.score_func == "sigmoid":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(self.n_limited_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)

    @torch.no_grad()
    def rebalance_(self) -> None:
        """The step's end: move the bias by this step's counts, bias += rate * sign(mean - count), then clear them.

        The counts are summed over the ranks first (`count_reduce`), so every rank moves its bias alike and keeps
        the same `tokens_per_expert`. With zero counts (no training forward) sign(0) leaves the bias unchanged.
        """
        counts = self.step_counts
        if self.count_reduce is not None:
            counts = self.count_reduce(counts)
        self.expert_bias.add_(torch.sign(counts.mean() - counts), alpha=self.bias_update_rate)
        self.tokens_per_expert.copy_(counts)
        self.step_counts.zero_()

    @torch.no_grad()
    def record_(self, counts: torch.Tensor) -> None:
        """Add this forward's per-expert counts to `step_counts` (once, not again when recomputed)."""
        if self.training and not recomputed_in_backward():
            self.step_counts.add_(counts.float())


def rebalance(model: nn.Module) -> None:
    """Once per training step, after its gradients: every router's bias moves by the step's counts
    (`Router.rebalance_`). The family's `ModelSpec.step_update`: the trainer traces it into the step's update."""
    for module in model.modules():
        if isinstance(module, Router):
            module.rebalance_()


# --------------------------------------------------------------------------- routed experts


class GroupedExperts(nn.Module):
    """All routed experts' SwiGLU weights stacked, [experts, in, out], run as grouped matmuls.

    `torch._grouped_mm(rows, w, offs)` multiplies each expert's contiguous block of rows by its own weight;
    `offs` (int32, cumulative row ends) is tensor data, so no shape depends on the routing.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """rows [N, dim] sorted by expert, offsets [experts] int32 -> [N, dim]."""
        w1, w2, w3 = (w.to(rows.dtype) for w in (self.w1, self.w2, self.w3))
        hidden = F.silu(torch._grouped_mm(rows, w1, offs=offsets)) * torch._grouped_mm(rows, w3, offs=offsets)
        return torch._grouped_mm(hidden, w2, offs=offsets)


class MoE(nn.Module):
    """Routed experts (each token's top-k, weighted by the router) plus shared experts (every token).

    Dropless and static: the T tokens' T*k (token, expert) pairs are sorted by expert into one buffer of
    T*k rows (a stable argsort: the permutation is tensor data), run through the grouped matmuls, weighted,
    and summed back per token with `index_add`, the dual of the `index_select` that gathered them.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.n_activated_experts
        self.router = Router(args)
        self.experts = GroupedExperts(args.n_routed_experts, args.dim, args.moe_inter_dim)
        self.shared_experts = (
            FeedForward(args.dim, args.n_shared_experts * args.moe_inter_dim) if args.n_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, dim]
        weights, experts = self.router(tokens)
        order, counts = dispatch_order(experts, self.n_experts)
        self.router.record_(counts)
        token_of_row = order // self.top_k  # the token each sorted row came from
        rows = tokens.index_select(0, token_of_row)
        out_rows = self.experts(rows, counts.cumsum(0).to(torch.int32))
        out_rows = out_rows * weights.flatten().index_select(0, order).unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, token_of_row, out_rows.type_as(tokens))
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)


def dispatch_order(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(permutation of the T*k flattened choices that sorts them by expert, stably; rows per expert [E] int64).

    Shapes depend on T, k and E only. An expert nobody chose gets an empty block; one chosen by every
    token gets all of them.
    """
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add(0, flat, torch.ones_like(flat))
    return order, counts


# --------------------------------------------------------------------------- transformer block


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(.)); the ffn is a MoE after the dense layers."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args) if layer_id >= args.n_dense_layers else None
        self.feed_forward = FeedForward(args.dim, args.inter_dim) if self.moe is None else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self, std: float = 0.02) -> None:
        """Every projection and expert weight truncated-normal(std); norms to one; balancing buffers to zero."""
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.trunc_normal_(p, mean=0.0, std=std)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.reset_parameters()
        if self.moe is not None:
            self.moe.router.expert_bias.zero_()
            self.moe.router.tokens_per_expert.zero_()
            self.moe.router.step_counts.zero_()


# --------------------------------------------------------------------------- the model


class DeepSeekV3(nn.Module):
    """DeepSeek-V3: token embedding, n_layers blocks (dense, then MoE), final norm, output projection."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(
            args.max_seq_len, args.qk_rope_head_dim // 2, functools.partial(rope_frequencies, args)
        )
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens LongTensor [B, S] -> logits [B, S, vocab_size]; `document_ids` as in Llama 3's `Transformer`."""
        return self.output(self.hidden_states(tokens, document_ids))

    def hidden_states(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] -> the normalized last hidden states [B, S, dim] that `output` projects to logits.

        `document_ids` [B, S] (models/common/documents.py): each packed document attends only within itself and
        its RoPE positions restart at 0. None: one causal sequence per row.
        """
        positions = None if document_ids is None else document_positions(document_ids)
        cos, sin = self.rope(tokens.shape[1], positions)
        h = self.tok_embeddings(tokens)
        mask = None if document_ids is None else document_mask(document_ids, attention_dtype(h))
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the buffers that pretrained weights do not set: the RoPE tables, from the config, and the
        balancing statistics, to zero. The router biases are zeroed too; a Hugging Face folder sets them after."""
        self.rope.reset_parameters()
        for layer in self.layers:
            if layer.moe is not None:
                for buffer in layer.moe.router.buffers():
                    buffer.zero_()

    def init_weights(self) -> None:
        """(Re)initialize parameters, RoPE tables and balancing buffers; deterministic under torch.manual_seed.

        A no-op on the meta device; call it after `to_empty()`.
        """
        if self.output.weight.device.type == "meta":
            return
        self.rope.reset_parameters()
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def routers(self) -> list[Router]:
        """The routers of the MoE layers, in layer order."""
        return [layer.moe.router for layer in self.layers if layer.moe is not None]


# --------------------------------------------------------------------------- helpers


def expert_load(model: nn.Module) -> dict[str, float]:
    """The last training step's expert load over every MoE layer: max and mean tokens per expert, and their
    ratio (1.0 is perfect balance). Empty for a model without routers (or on the meta device)."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers or routers[0].tokens_per_expert.device.type == "meta":
        return {}
    counts = torch.stack([r.tokens_per_expert for r in routers])  # [moe layers, experts]
    max_, mean = counts.amax(dim=-1), counts.mean(dim=-1)
    return {
        "max_tokens_per_expert": float(max_.max()),
        "mean_tokens_per_expert": float(mean.mean()),
        "max_over_mean": float((max_ / mean.clamp(min=1e-9)).max()),
    }


def _attention_params(args: ModelArgs) -> int:
    q_out = args.n_heads * args.qk_head_dim
    q = (
        args.dim * q_out
        if args.q_lora_rank == 0
        else args.dim * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * q_out
    )
    kv = args.dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank
    kv += args.kv_lora_rank * args.n_heads * (args.qk_nope_head_dim + args.v_head_dim)
    return q + kv + args.n_heads * args.v_head_dim * args.dim


def _param_counts(args: ModelArgs, routed_experts: int) -> int:
    """Parameters with `routed_experts` routed experts per MoE layer (all of them, or the activated ones)."""
    expert = 3 * args.dim * args.moe_inter_dim
    moe = args.n_routed_experts * args.dim + (routed_experts + args.n_shared_experts) * expert
    per_layer = _attention_params(args) + 2 * args.dim
    layers = args.n_layers * per_layer + args.n_dense_layers * 3 * args.dim * args.inter_dim + args.n_moe_layers * moe
    return 2 * args.vocab_size * args.dim + layers + args.dim


def num_params(args: ModelArgs) -> int:
    """Parameter count of `DeepSeekV3(args)` (buffers not counted), derived from the config alone."""
    return _param_counts(args, args.n_routed_experts)


def active_params(args: ModelArgs) -> int:
    """Parameters one token activates: every weight but the routed experts it does not pick."""
    return _param_counts(args, args.n_activated_experts)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the activated matmul parameters + the attention score and value matmuls.

    The embedding lookup is no matmul; the attention term is 6 * n_layers * n_heads * (qk + v head dims) *
    seq_len (forward and backward of QK^T and of the weighted sum of V, without causal halving).
    """
    n_matmul = active_params(args) - args.vocab_size * args.dim
    attention = 6.0 * args.n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return 6.0 * n_matmul + attention
