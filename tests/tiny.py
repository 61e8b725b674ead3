"""The tiny Llama most tests train, as command-line overrides: one definition instead of one per test module.

2 layers of width 64 with 4 query and 2 key/value heads (grouped-query attention), batches of 2 x 32 tokens,
deterministic kernels and no TensorBoard: small enough for CPU, with every feature of the real model.
"""


def tiny_model(layers: int = 2) -> list[str]:
    """The tiny model's overrides with `layers` transformer blocks."""
    return ["--model.n_layers", str(layers), "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2"]


TINY_BATCH = ["--training.seq_len", "32", "--training.local_batch_size", "2"]
DETERMINISTIC = ["--training.deterministic", "true", "--metrics.enable_tensorboard", "false"]
TINY = [*tiny_model(), *TINY_BATCH, *DETERMINISTIC]
