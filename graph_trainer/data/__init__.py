"""Training data: document sources, tokenizers, and packed resumable batches.

- `tokenizer`: the byte tokenizer and Hugging Face `tokenizer.json` files.
- `packing`: the one loader every source goes through (`PackedLoader`: batches, resume, rewind), the order a source
  hands its windows in (`WindowOrder`), and what a packed batch holds (tokens, labels, document ids).
- `loader`: the in-memory sources (embedded, text, jsonl, chat, synthetic) -> one token stream -> `ShuffledWindows`;
  `build_dataloader` builds this data-parallel rank's loader for any source.
- `hf_datasets`: files read with Hugging Face datasets, loaded or streamed, packed lane by lane (`DatasetLanes`).
- `chat`: instruction rows, rendered with the chat template, packed whole; only the answers count.
"""
