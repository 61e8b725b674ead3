"""Write a small dataset to train and validate on with `data.source = "hf_datasets"` (docs/data_and_validation.md).

    python examples/make_dataset.py outputs/data

writes into FOLDER (here outputs/data), from the pydoc topics every CPython ships (the embedded corpus, so nothing
is downloaded):
- FOLDER/train/part-00000.parquet, FOLDER/train/part-00001.parquet: the training rows, column "text";
- FOLDER/val.jsonl: every 5th topic, held out, one {"text": ...} record a line;
- FOLDER/body.jsonl: the held-out rows with their text in a column "body" (for --data.text_column body).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: str) -> None:
    from pydoc_data.topics import topics

    import datasets

    datasets.disable_progress_bars()
    texts = [topics[key] for key in sorted(topics)]
    train = [t for i, t in enumerate(texts) if i % 5 != 4]
    val = [t for i, t in enumerate(texts) if i % 5 == 4]
    folder = Path(out)
    (folder / "train").mkdir(parents=True, exist_ok=True)
    half = len(train) // 2
    for k, rows in enumerate((train[:half], train[half:])):
        datasets.Dataset.from_dict({"text": rows}).to_parquet(str(folder / "train" / f"part-{k:05d}.parquet"))
    (folder / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in val))
    (folder / "body.jsonl").write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(val)))
    print(f"wrote {len(train)} training rows to {folder / 'train'}, {len(val)} held-out rows to {folder / 'val.jsonl'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data")
