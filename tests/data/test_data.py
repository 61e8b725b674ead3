"""Tokenizers, sources, packing and the resumable, rank-sharded batch loader."""

import json
import sys
from itertools import islice

import pytest
import torch

from graph_trainer.data.loader import ShuffledWindows, build_dataloader, embedded_documents
from graph_trainer.data.packing import PackedLoader
from graph_trainer.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from graph_trainer.errors import ConfigError, UserError
from tests.extras import import_extra

BYTE = ByteTokenizer()


def embedded_loader(**overrides) -> PackedLoader:
    kwargs = dict(batch_size=4, seq_len=64, seed=0)
    kwargs.update(overrides)
    return build_dataloader("embedded", "", BYTE, **kwargs)


def shuffled(windows: torch.Tensor, **kwargs) -> PackedLoader:
    return PackedLoader(ShuffledWindows(windows, **kwargs))


def take(loader, n):
    return list(islice(loader, n))


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["input"], y["input"])
        assert torch.equal(x["labels"], y["labels"])


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    text = "Hello, wörld! ∑ 🚀\n\tdef f(x): return x"
    ids = BYTE.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert BYTE.decode(ids) == text
    assert BYTE.encode_to_tensor(text).tolist() == ids
    assert BYTE.encode_to_tensor("").numel() == 0
    assert (BYTE.bos_id, BYTE.eos_id, BYTE.vocab_size) == (256, 257, 258)
    # Specials are skipped; a broken UTF-8 sequence decodes to U+FFFD instead of raising.
    assert BYTE.decode([BYTE.bos_id, *ids, BYTE.eos_id]) == text
    assert BYTE.decode([0xF0, 0x9F]) == "\ufffd"
    assert build_tokenizer("byte").vocab_size == 258


def test_hf_tokenizer_loads_and_encodes(tmp_path):
    tokenizers = import_extra("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the cat sat on the mat", "the dog sat on the log"] * 5, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    hf = build_tokenizer(str(path))
    assert isinstance(hf, HFTokenizer)
    assert (hf.bos_id, hf.eos_id) == (1, 2)
    assert hf.vocab_size == tok.get_vocab_size()
    ids = hf.encode("the cat sat")
    assert ids and all(0 <= i < hf.vocab_size for i in ids)
    assert hf.eos_id not in ids
    assert hf.encode_to_tensor("the cat sat").tolist() == ids
    assert hf.decode(ids + [hf.eos_id]).split() == ["the", "cat", "sat"]
    assert build_tokenizer(str(tmp_path)).vocab_size == hf.vocab_size  # a folder holding tokenizer.json

    # The stream puts the tokenizer's EOS after every document.
    (tmp_path / "a.txt").write_text("the cat")
    (tmp_path / "b.txt").write_text("the dog")
    loader = build_dataloader("text", str(tmp_path), hf, batch_size=1, seq_len=1, seed=0)
    expected = hf.encode("the cat") + [hf.eos_id] + hf.encode("the dog") + [hf.eos_id]
    assert loader.order.windows.flatten().tolist() == expected[: loader.order.num_tokens]
    assert loader.order.num_tokens == len(expected) // 2 * 2


def test_hf_tokenizer_without_specials_has_no_eos(tmp_path):
    tokenizers = import_extra("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    assert hf.eos_id is None and hf.bos_id is None
    assert hf.encode("a b a") == [0, 1, 0]


def test_missing_tokenizers_library_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(UserError, match=r"pip install 'graph_trainer\[tokenizers\]'"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


def test_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match=r"data\.tokenizer.*nope\.json"):
        build_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(UserError, match=r"data\.tokenizer.*bad\.json"):
        build_tokenizer(str(bad))


# ---------------------------------------------------------------- sources


def test_embedded_source_is_large_and_deterministic():
    docs = list(embedded_documents())
    assert len(docs) > 50
    assert sum(len(d.encode("utf-8")) for d in docs) > 400_000
    assert docs == list(embedded_documents())
    a, b = embedded_loader(), embedded_loader()
    assert torch.equal(a.order.windows, b.order.windows)
    # EOS separates every document in the stream.
    assert (a.order.windows == BYTE.eos_id).sum() >= len(docs) - 2


def test_text_source_reads_files_recursively_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("BBBB")
    (tmp_path / "a.txt").write_text("AAAA")
    (tmp_path / "sub" / "c.py").write_text("CCCC")
    (tmp_path / "skip.bin").write_bytes(b"XXXX")
    loader = build_dataloader("text", str(tmp_path), BYTE, batch_size=1, seq_len=4, seed=0)
    stream = BYTE.decode(loader.order.windows.flatten().tolist())
    assert stream == "AAAABBBBCCCC"  # sorted paths, EOS (skipped by decode) between files, .bin ignored
    assert loader.order.windows.numel() == 15  # 3 x (4 + EOS)

    single = tmp_path / "skip.bin"  # a single file is read whatever its suffix
    loader = build_dataloader("text", str(single), BYTE, batch_size=1, seq_len=2, seed=0)
    assert loader.order.windows.flatten().tolist()[:3] == list(b"XXX")


def test_jsonl_source(tmp_path):
    lines = [json.dumps({"text": "hello"}), "", json.dumps({"text": "world", "id": 3})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    loader = build_dataloader("jsonl", str(tmp_path), BYTE, batch_size=1, seq_len=5, seed=0)
    assert loader.order.windows.tolist() == [list(b"hello") + [257], list(b"world") + [257]]


def test_synthetic_source_is_seeded_and_in_vocab():
    a = build_dataloader("synthetic", "", BYTE, batch_size=2, seq_len=16, seed=3)
    b = build_dataloader("synthetic", "", BYTE, batch_size=2, seq_len=16, seed=3)
    c = build_dataloader("synthetic", "", BYTE, batch_size=2, seq_len=16, seed=4)
    assert torch.equal(a.order.windows, b.order.windows)
    assert not torch.equal(a.order.windows, c.order.windows)
    assert 0 <= a.order.windows.min() and a.order.windows.max() < BYTE.vocab_size
    assert_batches_equal(take(a, 3), take(b, 3))


# ---------------------------------------------------------------- batches


def test_batch_format_and_labels_are_inputs_shifted_by_one():
    batch = next(embedded_loader())
    assert set(batch) == {"input", "labels"}
    for t in batch.values():
        assert t.dtype == torch.long and t.shape == (4, 64) and t.device.type == "cpu" and t.is_contiguous()
    assert torch.equal(batch["input"][:, 1:], batch["labels"][:, :-1])


def test_same_seed_same_batches_different_seed_different_order():
    a, b, c = embedded_loader(seed=1), embedded_loader(seed=1), embedded_loader(seed=2)
    ba, bb, bc = take(a, 4), take(b, 4), take(c, 4)
    assert_batches_equal(ba, bb)
    assert not all(torch.equal(x["input"], y["input"]) for x, y in zip(ba, bc, strict=True))


def test_resume_from_state_yields_the_same_next_batches():
    original = embedded_loader(seed=5)
    take(original, 7)
    state = original.state_dict()
    assert state == {"order": "in-memory windows", "epoch": 0, "batch_index": 7}
    restored = embedded_loader(seed=5)
    restored.load_state_dict(state)
    assert_batches_equal(take(original, 5), take(restored, 5))


def test_resume_across_epoch_boundary():
    # Tiny data: 2 batches per epoch, so 5 batches cross two epoch boundaries.
    original = embedded_loader(seed=5)
    small = shuffled(original.order.windows[:8], batch_size=4, seed=5)
    take(small, 5)
    again = shuffled(original.order.windows[:8], batch_size=4, seed=5)
    again.load_state_dict(small.state_dict())
    assert_batches_equal(take(small, 5), take(again, 5))
    with pytest.raises(UserError, match="batches per epoch"):
        again.load_state_dict({"epoch": 0, "batch_index": 3})
    again.load_state_dict({"epoch": 1, "batch_index": 1})  # a checkpoint from before the order's tag still resumes
    assert again.order.position() == {"epoch": 1, "batch_index": 1}


def test_epoch_rollover_increments_epoch_and_reshuffles():
    loader = shuffled(embedded_loader().order.windows[:12], batch_size=4, seed=0)
    assert loader.order.batches_per_epoch == 3
    first = take(loader, 3)
    assert loader.order.epoch == 0
    second = take(loader, 3)
    assert loader.order.epoch == 1
    take(loader, 1)
    assert loader.order.epoch == 2 and loader.order.position() == {"epoch": 2, "batch_index": 1}
    # Each epoch visits every window exactly once, in a new order.
    for epoch in (first, second):
        rows = torch.cat([b["input"] for b in epoch])
        assert rows.shape[0] == 12 and torch.unique(rows, dim=0).shape[0] == 12
    assert not all(torch.equal(x["input"], y["input"]) for x, y in zip(first, second, strict=True))


def test_partial_last_batch_is_dropped():
    windows = embedded_loader().order.windows[:10]
    loader = shuffled(windows, batch_size=4, seed=0)
    assert loader.order.batches_per_epoch == 2
    assert all(b["input"].shape[0] == 4 for b in take(loader, 5))


def test_rank_sharding_gives_disjoint_batches():
    world = 2
    loaders = [embedded_loader(batch_size=2, rank=r, world_size=world) for r in range(world)]
    full = embedded_loader(batch_size=2)
    assert all(ld.order.batches_per_epoch == full.order.batches_per_epoch // world for ld in loaders)
    per_rank = [take(ld, 6) for ld in loaders]
    expected = take(full, 12)
    for r in range(world):
        # Rank r gets every world_size-th batch of the single-rank order.
        assert_batches_equal(per_rank[r], expected[r::world])
    rows = [{tuple(row.tolist()) for b in batches for row in b["input"]} for batches in per_rank]
    assert rows[0].isdisjoint(rows[1])


def test_a_global_batch_is_the_same_windows_at_any_number_of_data_ranks():
    """Global batch 4 as 1 x 4, 2 x 2 and 4 x 1: every step's rows are the same windows in the same order, and a
    position saved at 2 data ranks resumes at 4 on the very next global batch (a reshard continues the run)."""

    def ranks(n: int) -> list[PackedLoader]:
        return [embedded_loader(batch_size=4 // n, rank=r, world_size=n, seed=7) for r in range(n)]

    def global_batches(loaders: list[PackedLoader], steps: int) -> list[torch.Tensor]:
        return [torch.cat([next(it)["input"] for it in loaders]) for _ in range(steps)]

    whole = global_batches(ranks(1), 9)
    for n in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(global_batches(ranks(n), 9), whole, strict=True))
    two, four = ranks(2), ranks(4)
    global_batches(two, 5)
    assert len({json.dumps(it.state_dict()) for it in two}) == 1  # every data rank writes the same position
    for it in four:
        it.load_state_dict(two[0].state_dict())
    assert all(torch.equal(a, b) for a, b in zip(global_batches(four, 4), whole[5:], strict=True))


def test_every_source_the_loader_reads_is_an_option_and_no_other():
    """`data.source`'s choices (job_config/schema.py, below data/ in the import order) name exactly the loader's
    sources: a new document source registered in `DOCUMENT_SOURCES` but not in the schema fails here."""
    import dataclasses

    from graph_trainer.data.loader import SOURCES
    from graph_trainer.job_config.schema import DataConfig

    (source,) = (f for f in dataclasses.fields(DataConfig) if f.name == "source")
    assert sorted(source.metadata["choices"]) == sorted(SOURCES)


# ---------------------------------------------------------------- errors


def test_missing_path_is_a_user_error(tmp_path):
    missing = tmp_path / "nowhere"
    for source in ("text", "jsonl"):
        with pytest.raises(UserError, match=rf"data\.path '{missing}' does not exist"):
            build_dataloader(source, str(missing), BYTE, batch_size=1, seq_len=4, seed=0)
    with pytest.raises(UserError, match=r"data\.path is empty"):
        build_dataloader("text", "", BYTE, batch_size=1, seq_len=4, seed=0)


def test_empty_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=rf"data\.path '{tmp_path}' holds no"):
        build_dataloader("text", str(tmp_path), BYTE, batch_size=1, seq_len=4, seed=0)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match=r"data\.path .*\(0 tokens\)"):
        build_dataloader("text", str(tmp_path), BYTE, batch_size=1, seq_len=4, seed=0)


def test_bad_jsonl_line_is_a_user_error_naming_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(UserError, match=rf"{f}:2: no string \"text\" field"):
        build_dataloader("jsonl", str(f), BYTE, batch_size=1, seq_len=1, seed=0)
    f.write_text(json.dumps({"text": "ok"}) + "\n{broken\n")
    with pytest.raises(UserError, match=rf"{f}:2: not valid JSON"):
        build_dataloader("jsonl", str(f), BYTE, batch_size=1, seq_len=1, seed=0)


def test_too_little_data_is_a_user_error_with_counts(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 99)  # 100 tokens with EOS
    expected = r"has 100 tokens but one batch needs 260 .*training\.seq_len.*training\.local_batch_size"
    with pytest.raises(UserError, match=expected):
        build_dataloader("text", str(tmp_path), BYTE, batch_size=4, seq_len=64, seed=0)
    with pytest.raises(UserError, match=r"needs 130 .*on each of 2 ranks"):
        build_dataloader("text", str(tmp_path), BYTE, batch_size=1, seq_len=64, seed=0, world_size=2)


def test_unknown_source_is_a_config_error_listing_valid_ones():
    expected = r"data\.source \"embeded\".*did you mean \"embedded\".*embedded, jsonl, synthetic, text"
    with pytest.raises(ConfigError, match=expected):
        build_dataloader("embeded", "", BYTE, batch_size=1, seq_len=4, seed=0)


def test_a_binary_file_as_text_is_refused_in_one_line_and_a_few_bad_bytes_warn(tmp_path, caplog):
    """Issue 8.9: a binary file given as data.source = text trained on garbage without a word."""
    from tests.checkpoint.test_run_folder import cli, one_line_error

    binary = tmp_path / "model.txt"
    binary.write_bytes(bytes(range(256)) * 200)
    proc = cli(
        "--training.steps",
        "1",
        "--data.source",
        "text",
        "--data.path",
        str(binary),
        "--job.dump_folder",
        str(tmp_path / "run"),
        cwd=tmp_path,
    )
    one_line_error(proc, f"data.path file '{binary}' does not look like text")
    assert not (tmp_path / "run").exists()
    mostly_text = tmp_path / "latin1.txt"
    mostly_text.write_bytes("caf\u00e9 au lait. ".encode("latin-1") * 300)
    loader = build_dataloader("text", str(mostly_text), ByteTokenizer(), batch_size=2, seq_len=16, seed=0)
    assert loader.order.num_tokens > 0
    assert "300 invalid UTF-8 sequences were replaced" in caplog.text
