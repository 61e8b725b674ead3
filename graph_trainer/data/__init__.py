"""Training data: document sources, tokenizers, and packed resumable batches.

- `tokenizer`: the byte tokenizer and Hugging Face `tokenizer.json` files.
- `packing`: what a packed batch holds (tokens, labels, and with document masking the rows' document ids).
- `loader`: sources -> one token stream -> `PackedBatchLoader` (this data-parallel rank's batches).
"""
