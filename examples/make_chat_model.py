"""Write a stand-in for a downloaded instruct model and a file of chats, to fine-tune on (README.md, docs/data.md).

    python examples/make_chat_model.py outputs/chat

writes into FOLDER (here outputs/chat), with nothing downloaded:
- FOLDER/model: a random 6-layer Llama written by transformers (`save_pretrained`), with a byte-level BPE
  `tokenizer.json` trained by the `tokenizers` library and a `tokenizer_config.json` that declares BOS, EOS
  (`<|eot_id|>`, the end of a turn, as Llama 3 Instruct declares it) and a chat template of Llama 3's shape;
- FOLDER/chats.jsonl: 64 short conversations of arithmetic questions, one {"messages": [...]} a line;
- FOLDER/held_out.jsonl: 16 more, for validation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
VOCAB = 512


def chats(first: int, count: int) -> list[dict]:
    """`count` conversations: a system line, then one or two questions, each with its answer."""
    rows = []
    for i in range(first, first + count):
        a, b = i % 9 + 1, i // 9 % 9 + 1
        messages = [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
        if i % 2:
            messages += [
                {"role": "user", "content": f"And {a} times {b}?"},
                {"role": "assistant", "content": f"{a} times {b} is {a * b}."},
            ]
        rows.append({"messages": messages})
    return rows


def main(out: str) -> None:
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder = Path(out)
    model = folder / "model"
    model.mkdir(parents=True, exist_ok=True)
    train, held_out = chats(0, 64), chats(64, 16)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for row in train for m in row["messages"]]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(model / "tokenizer.json"))
    declared = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATE}
    (model / "tokenizer_config.json").write_text(json.dumps(declared, indent=1))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(model)
    for name, rows in (("chats.jsonl", train), ("held_out.jsonl", held_out)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote a 6-layer model with its tokenizer and chat template to {model}, {len(train)} chats to "
          f"{folder / 'chats.jsonl'} and {len(held_out)} to {folder / 'held_out.jsonl'}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "chat")
