"""Data loading alone: the embedded source against the same text read with Hugging Face datasets.

    python benchmarks/data_sources.py [--batches 50] [--batch 16] [--seq-len 512]

The pydoc topics (the embedded corpus) are written once as a parquet file; then each source builds its loader
(`build` time: reading, and for `embedded` tokenizing everything) and yields `--batches` batches of the debug
config's shape (`tokens/s` of the loader alone, no model). `hf_datasets` tokenizes as it reads. Prints one row
per source and the ratio of its tokens/s to the embedded source's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_trainer.data.loader import build_dataloader, embedded_documents  # noqa: E402
from graph_trainer.data.tokenizer import ByteTokenizer  # noqa: E402


def measure(source: str, path: str, batches: int, batch: int, seq_len: int, **kw) -> tuple[float, float, float]:
    """(build seconds, tokens per second over `batches` batches, both together in seconds) of one source."""
    start = time.perf_counter()
    loader = build_dataloader(source, path, ByteTokenizer(), batch_size=batch, seq_len=seq_len, seed=0, **kw)
    built = time.perf_counter()
    for _ in islice(loader, batches):
        pass
    elapsed = time.perf_counter() - built
    return built - start, batches * batch * seq_len / elapsed, built - start + elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    a = parser.parse_args()
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "corpus.parquet")
        datasets.Dataset.from_dict({"text": list(embedded_documents())}).to_parquet(path)
        rows = {
            "embedded": measure("embedded", "", a.batches, a.batch, a.seq_len),
            "hf_datasets (loaded)": measure("hf_datasets", path, a.batches, a.batch, a.seq_len),
            "hf_datasets (streaming)": measure("hf_datasets", path, a.batches, a.batch, a.seq_len, streaming=True),
        }
    base = rows["embedded"][1]
    print(f"{a.batches} batches of {a.batch} x {a.seq_len} tokens\n")
    print("| source | build s | batches: tokens/s | vs embedded | build + batches s |\n|---|---|---|---|---|")
    for name, (build, tps, total) in rows.items():
        print(f"| {name} | {build:.2f} | {tps:,.0f} | {tps / base:.2f} | {total:.2f} |")


if __name__ == "__main__":
    main()
