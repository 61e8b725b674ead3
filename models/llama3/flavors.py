"""Named Llama-3 sizes.

Dimensions are Meta's published ones; see tests/models/test_models.py for their parameter counts.
"""

from models.llama3.model import ModelArgs

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    # Small enough to train on a laptop CPU; FFN hidden 768.
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000.0),
    # Llama 3.2 1B: tied embeddings, RoPE scaled by 32 for long context; FFN hidden 8192.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000.0,
        use_rope_scaling=True,
        scaling_factor=32.0,
        tie_embeddings=True,
    ),
    # Llama 3 8B: FFN hidden 14336, 8,030,261,248 parameters.
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # Llama 3 70B: FFN hidden 28672.
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
}
