"""Tests for models/: parameter counts, forward semantics, init, GQA, RoPE, the registry, and the SDPA kernel choice."""

import dataclasses
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.model_args import build_model_args, get_model_spec
from models import MODELS
from models.common.rope import apply_rotary
from models.common.spec import ModelArgsError
from models.llama3 import LLAMA3_FLAVORS, ModelArgs, Transformer, ffn_hidden_dim, flops_per_token, num_params
from models.llama3.model import rope_frequencies

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=32)

# FFN hidden sizes as published by Meta; the formula in ffn_hidden_dim must reproduce them.
PUBLISHED_FFN_HIDDEN = {"debugmodel": 768, "1B": 8192, "8B": 14336, "70B": 28672}


def _expected_params(args: ModelArgs, ffn_hidden: int) -> int:
    """Parameter count written out from the architecture, independent of the model code."""
    kv_dim = (args.n_kv_heads or args.n_heads) * (args.dim // args.n_heads)
    per_layer = (
        args.dim * args.dim  # wq
        + 2 * args.dim * kv_dim  # wk, wv
        + args.dim * args.dim  # wo
        + 3 * args.dim * ffn_hidden  # w1, w2, w3
        + 2 * args.dim  # attention_norm, ffn_norm
    )
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return embeddings + args.n_layers * per_layer + args.dim  # + final norm


def _meta_model(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def _materialize(args: ModelArgs, seed: int) -> Transformer:
    model = _meta_model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("flavor", sorted(LLAMA3_FLAVORS))
def test_flavor_parameter_counts_match_architecture(flavor):
    args = LLAMA3_FLAVORS[flavor]
    assert ffn_hidden_dim(args) == PUBLISHED_FFN_HIDDEN[flavor]
    model = _meta_model(args)
    count = num_params(model)
    print(f"{flavor}: {count:,} parameters ({num_params(model, exclude_embedding=True):,} without the embedding)")
    assert count == _expected_params(args, PUBLISHED_FFN_HIDDEN[flavor])
    assert all(p.is_meta for p in model.parameters())


def test_8b_has_exactly_published_parameter_count():
    assert num_params(_meta_model(LLAMA3_FLAVORS["8B"])) == 8_030_261_248


def test_parameter_names_follow_meta_checkpoints():
    names = {name for name, _ in _meta_model(TINY).named_parameters()}
    expected = {
        "tok_embeddings.weight",
        "layers.0.attention.wq.weight",
        "layers.1.feed_forward.w3.weight",
        "layers.0.attention_norm.weight",
        "layers.0.ffn_norm.weight",
        "norm.weight",
        "output.weight",
    }
    assert expected <= names
    assert not any("rope" in name for name, _ in _meta_model(TINY).state_dict().items()), (
        "RoPE tables must not be saved"
    )


def test_flops_per_token_is_standard_estimate():
    args = LLAMA3_FLAVORS["8B"]
    non_embedding = 8_030_261_248 - args.vocab_size * args.dim
    assert flops_per_token(args, 8192) == 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    # Tied output projection still runs its matmul, so it still costs FLOPs.
    tied = LLAMA3_FLAVORS["1B"]
    n = num_params(_meta_model(tied))
    assert flops_per_token(tied, 1) == 6 * n + 12 * tied.n_layers * tied.dim


# --------------------------------------------------------------------------- forward


def test_forward_shape_and_dtype():
    torch.manual_seed(0)
    model = Transformer(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.to(torch.bfloat16)(tokens).dtype == torch.bfloat16


def test_forward_is_causal():
    torch.manual_seed(0)
    model = Transformer(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % TINY.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :8], b[:, :8])
    assert not torch.equal(a[:, 8:], b[:, 8:])


def test_sequence_longer_than_max_seq_len_is_an_error_naming_max_seq_len():
    # The model raises ValueError (models/ import no graph_trainer); a job refuses the same seq_len earlier, as a
    # config error (tests/job_config/test_config.py).
    model = Transformer(TINY)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_tied_embeddings_share_one_parameter():
    args = dataclasses.replace(TINY, tie_embeddings=True)
    model = Transformer(args)
    assert model.output.weight is model.tok_embeddings.weight
    shared = [name for name, _ in model.named_parameters() if name in ("output.weight", "tok_embeddings.weight")]
    assert shared == ["tok_embeddings.weight"]
    assert num_params(model) == _expected_params(args, ffn_hidden_dim(args))
    # The meta -> real path keeps the tie too.
    materialized = _materialize(args, seed=0)
    assert materialized.output.weight is materialized.tok_embeddings.weight
    assert torch.isfinite(materialized(torch.zeros(1, 4, dtype=torch.long))).all()
    # The shared tensor takes the output projection's init (std dim**-0.5, cut at 3 std), not the embedding's std 1.0.
    assert materialized.output.weight.abs().max().item() <= 3 * args.dim**-0.5


def test_grouped_query_attention_matches_reference():
    """n_kv_heads < n_heads: each KV head serves n_heads / n_kv_heads consecutive query heads."""
    torch.manual_seed(0)
    args = dataclasses.replace(TINY, n_heads=8, n_kv_heads=2)
    attention = Transformer(args).layers[0].attention
    assert attention.wk.weight.shape == (2 * args.head_dim, args.dim)
    x = torch.randn(2, 10, args.dim)
    cos, sin = Transformer(args).rope(10)
    out = attention(x, cos, sin)

    q = apply_rotary(attention.wq(x).view(2, 10, 8, -1), cos, sin).transpose(1, 2)
    k = apply_rotary(attention.wk(x).view(2, 10, 2, -1), cos, sin).transpose(1, 2).repeat_interleave(4, dim=1)
    v = attention.wv(x).view(2, 10, 2, -1).transpose(1, 2).repeat_interleave(4, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(args.head_dim)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    reference = attention.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, -1))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_make_fx_uses_cpu_flash_attention_once_per_layer():
    torch.manual_seed(0)
    model = Transformer(TINY)  # GQA: the KV expansion must not push SDPA off the fused kernel
    gm = make_fx(model)(torch.randint(0, TINY.vocab_size, (2, 16)))
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert targets.count(flash) == TINY.n_layers
    assert not any("_scaled_dot_product_attention_math" in str(t) for t in targets)


def test_dropout_only_in_graph_when_enabled():
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    no_dropout = make_fx(Transformer(TINY).train())(tokens)
    assert not any("dropout" in str(n.target) or "bernoulli" in str(n.target) for n in no_dropout.graph.nodes)

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(TINY, dropout=0.5)).train()
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


# --------------------------------------------------------------------------- init


def test_meta_init_is_deterministic_and_finite():
    a, b, c = _materialize(TINY, seed=7), _materialize(TINY, seed=7), _materialize(TINY, seed=8)
    state_a, state_b = a.state_dict(), b.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not torch.equal(a.layers[0].attention.wq.weight, c.layers[0].attention.wq.weight)
    # RoPE tables are recomputed, not left as to_empty() garbage.
    direct = Transformer(TINY)
    assert torch.equal(a.rope.cos, direct.rope.cos) and torch.equal(a.rope.sin, direct.rope.sin)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    assert torch.isfinite(a(tokens)).all()
    assert torch.equal(a(tokens), b(tokens))


def test_init_weights_uses_depth_scaled_truncated_normals():
    args = ModelArgs(dim=256, n_layers=8, n_heads=4, vocab_size=512, multiple_of=256, max_seq_len=8)
    model = _materialize(args, seed=0)

    def std(t):
        return t.float().std().item()

    assert std(model.layers[0].attention.wq.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.layers[0].attention.wo.weight) == pytest.approx(0.02 / math.sqrt(2), rel=0.05)
    assert std(model.layers[7].feed_forward.w2.weight) == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert std(model.tok_embeddings.weight) == pytest.approx(1.0, rel=0.05)
    out_std = args.dim**-0.5
    assert model.output.weight.abs().max().item() <= 3 * out_std
    assert torch.equal(model.norm.weight, torch.ones(args.dim))

    flat = _materialize(dataclasses.replace(args, depth_init=False), seed=0)
    assert std(flat.layers[0].attention.wo.weight) == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


# --------------------------------------------------------------------------- RoPE


def test_rotary_matches_complex_formulation():
    """Meta's reference rotates (x[2i], x[2i+1]) as one complex number; ours must agree so its weights load as-is."""
    torch.manual_seed(0)
    args = dataclasses.replace(TINY, max_seq_len=16)
    rope = Transformer(args).rope
    cos, sin = rope(16)
    x = torch.randn(2, 16, 3, args.head_dim)
    angles = torch.outer(torch.arange(16, dtype=torch.float32), rope_frequencies(args))
    freqs_cis = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    reference = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs_cis).flatten(-2)
    torch.testing.assert_close(apply_rotary(x, cos, sin), reference, rtol=1e-5, atol=1e-5)


def test_rope_scaling_matches_llama31_rule():
    args = LLAMA3_FLAVORS["1B"]
    base = rope_frequencies(dataclasses.replace(args, use_rope_scaling=False))
    expected = []
    for freq in base.tolist():  # Meta's per-frequency loop, written out
        wavelen = 2 * math.pi / freq
        if wavelen < args.original_max_seq_len / args.high_freq_factor:
            expected.append(freq)
        elif wavelen > args.original_max_seq_len / args.low_freq_factor:
            expected.append(freq / args.scaling_factor)
        else:
            smooth = (args.original_max_seq_len / wavelen - args.low_freq_factor) / (
                args.high_freq_factor - args.low_freq_factor
            )
            expected.append((1 - smooth) * freq / args.scaling_factor + smooth * freq)
    scaled = rope_frequencies(args)
    torch.testing.assert_close(scaled, torch.tensor(expected), rtol=1e-6, atol=0)
    assert scaled[0] == base[0] and scaled[-1] == base[-1] / 32  # highest kept, lowest stretched


# --------------------------------------------------------------------------- registry and validation


def test_registry_builds_args_with_non_none_overrides():
    assert get_model_spec("llama3") is MODELS["llama3"]
    args = build_model_args("llama3", "debugmodel", {"n_layers": 2, "vocab_size": None, "dropout": 0.1})
    assert args.n_layers == 2 and args.dropout == 0.1
    assert args.vocab_size == LLAMA3_FLAVORS["debugmodel"].vocab_size
    assert LLAMA3_FLAVORS["debugmodel"].n_layers == 6, "overrides must not touch the shared flavor"
    assert isinstance(get_model_spec("llama3").model_cls(dataclasses.replace(args, dim=32, n_heads=2)), Transformer)


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: build_model_args("llama3", "8b", {}), r"flavor '8b'.*debugmodel.*Did you mean '8B'"),
        (lambda: build_model_args("llama", "8B", {}), r"model 'llama'.*Did you mean 'llama3'"),
        (lambda: get_model_spec("gpt"), r"unknown model 'gpt'; available: llama3"),
        (lambda: build_model_args("llama3", "8B", {"n_layer": 2}), r"field 'n_layer'.*Did you mean 'n_layers'"),
        (lambda: build_model_args("llama3", "debugmodel", {"dim": 100, "n_heads": 3}), r"not divisible by n_heads"),
        (lambda: build_model_args("llama3", "debugmodel", {"n_kv_heads": 3}), r"not a multiple of n_kv_heads"),
        (lambda: build_model_args("llama3", "debugmodel", {"dropout": 1.0}), r"dropout"),
    ],
)
def test_user_mistakes_are_config_errors(call, pattern):
    with pytest.raises(ConfigError, match=pattern):
        call()


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"dim": 100, "n_heads": 3}, r"not divisible by n_heads"),
        ({"dim": 64, "n_heads": 4, "n_kv_heads": 3}, r"not a multiple of n_kv_heads"),
        ({"dim": 64, "n_heads": 4, "dropout": 1.0}, r"dropout"),
    ],
)
def test_impossible_model_args_raise_the_models_own_error(kwargs, pattern):
    # models/ import nothing from graph_trainer: the family raises ModelArgsError, the registry (above) turns it
    # into the ConfigError a user sees.
    with pytest.raises(ModelArgsError, match=pattern):
        ModelArgs(**kwargs)


def test_flavors_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA3_FLAVORS["8B"].dim = 1
