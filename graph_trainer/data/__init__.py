"""Training data: document sources, tokenizers, and packed resumable batches.

- `tokenizer`: the byte tokenizer and Hugging Face `tokenizer.json` files.
- `loader`: sources -> one token stream -> `PackedBatchLoader` (this data-parallel rank's batches).
"""
