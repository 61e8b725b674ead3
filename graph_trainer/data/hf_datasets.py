"""Documents read with Hugging Face `datasets` (`data.source = "hf_datasets"`), packed in order.

What it reads (`data.path`): a local parquet, json/jsonl or arrow file, a folder of such files (one format,
every file below it, sorted), or a folder written by `Dataset.save_to_disk`. The text is the column
`data.text_column`. Loaded whole, the data is a memory-mapped Arrow table (`datasets` converts json and
parquet into its cache once); with `data.streaming` it is an `IterableDataset` read file by file, never held.

Rank r of N (the data-parallel rank and size: tensor-parallel peers read the same batches) reads its own slice:
a loaded dataset is cut into N contiguous row ranges (`Dataset.shard(N, r, contiguous=True)`); a stream is split
by `datasets.distributed.split_dataset_by_node` (whole files per rank when the number of files divides by N,
else every N-th row). No rank tokenizes another rank's documents.

Packing, as the other sources do: each document's ids are followed by EOS and the stream is cut into windows of
seq_len + 1 tokens; a batch is `local_batch_size` consecutive windows. At the end of the slice a new pass (epoch)
starts from its first row, and the stream runs on across the boundary. The rows come in the dataset's order, or
with `data.shuffle` in an order drawn per pass from `(training.seed, epoch)`: a loaded slice is permuted whole
(`Dataset.shuffle`, an index mapping kept in memory: nothing is written to the datasets cache); a stream is
shuffled within a buffer of `data.shuffle_buffer` rows, its files' order drawn too (`IterableDataset.shuffle` and
`set_epoch`; when the ranks read whole files, the files are dealt to them anew each pass). Every rank draws with
the same seed, so the slices stay disjoint. Either order is a function of the seed and the pass alone, so a
resume re-draws it and the position below still names the same rows.

Position: `(epoch, doc, token)`, the next window starts at token `token` of row `doc` of the rank's slice (in
that pass's order) in pass `epoch`. Resuming re-opens the slice at row `doc` (`skip`: an index for a loaded
dataset; a re-read of the rows before it for a stream) and re-tokenizes that one row, so the batches after a
resume are exactly those the run would have read. Every data-parallel rank has its own position; `state_dict`
gathers all of them (through `gather`, a collective: every rank calls it), so a checkpoint written by one rank
restores every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from graph_trainer.data.packing import packed_batch
from graph_trainer.data.tokenizer import Tokenizer
from graph_trainer.errors import UserError
from graph_trainer.observability.log import get_logger

logger = get_logger(__name__)

SOURCE = "hf_datasets"
# File suffix -> the `datasets` builder that reads it.
FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # a `save_to_disk` folder
_READ_BATCH = 256  # rows fetched from Arrow at a time: far faster than row by row, little memory

# Gathers one picklable value from every data-parallel rank, in data-rank order (None: one data rank).
Gather = Callable[[Any], list[Any]]
# rows(start, epoch): the texts of a rank's slice from row `start` on, in pass `epoch`'s order.
Rows = Callable[[int, int], Iterator[str]]


@dataclass(frozen=True)
class Shuffle:
    """How the rows are shuffled: one order per pass, drawn from `seed + epoch`; `buffer` rows for a stream."""

    seed: int
    buffer: int


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise UserError(
            f'data.source = "{SOURCE}" needs the Hugging Face datasets package, which is not installed; '
            "run: pip install 'graph_trainer[datasets]'"
        ) from None
    datasets.disable_progress_bars()  # one bar per file and split on every rank otherwise
    datasets.logging.set_verbosity_error()
    return datasets


def _files(root: Path, option: str) -> tuple[str, list[str]]:
    """(builder, files) for a file or a folder of files of one known format."""
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in FORMATS)
    if not files:
        raise UserError(
            f"{option} '{root}' holds no {'/'.join(FORMATS)} files and is not a folder written by "
            f'save_to_disk; point {option} at such files for data.source = "{SOURCE}"'
        )
    builders = {FORMATS.get(f.suffix) for f in files}
    if None in builders:
        raise UserError(
            f"{option} '{root}' is not a {'/'.join(FORMATS)} file; point {option} at a dataset file "
            f'for data.source = "{SOURCE}" (or use data.source = "text" for plain text)'
        )
    if len(builders) > 1:
        raise UserError(f"{option} '{root}' mixes {' and '.join(sorted(builders))} files; keep one format per folder")
    return builders.pop(), [str(f) for f in files]


def _cause(e: BaseException) -> str:
    """The first line of an exception and of its causes, for a one-line message."""
    while e.__cause__ is not None and not str(e).strip():
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def open_dataset(path: str, *, streaming: bool, option: str = "data.path") -> Any:
    """The dataset at `path` (a `Dataset`, or an `IterableDataset` when `streaming`).

    Raises:
        UserError: a missing path, an unknown format, or files `datasets` cannot read as a dataset.
    """
    datasets = _import_datasets()
    if not path:
        raise UserError(f'{option} is empty but data.source = "{SOURCE}" reads files; set {option}')
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"{option} '{root}' does not exist; set {option} to a dataset file or folder")
    try:
        if root.is_dir() and any((root / m).is_file() for m in _SAVED_MARKERS):
            ds = datasets.load_from_disk(str(root))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise UserError(f"{option} '{root}' holds the splits {sorted(ds)} but no 'train'; save one")
                ds = ds["train"]
            return ds.to_iterable_dataset() if streaming else ds
        builder, files = _files(root, option)
        return datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming)
    except UserError:
        raise
    except Exception as e:  # pyarrow, json and datasets each raise their own types for an unreadable file
        raise UserError(
            f"{option} '{root}' cannot be read as a dataset ({_cause(e)}); point {option} at parquet, "
            "json/jsonl or arrow files"
        ) from None


def column_checked(ds: Any, column: str, where: str) -> Any:
    """`ds` reduced to its text column, after checking that the column exists and holds strings.

    Raises:
        UserError: no such column (the message lists the columns there are), or a first value that is no string.
    """
    try:
        first = next(iter(ds.take(1))) if _is_stream(ds) else (ds[0] if len(ds) else None)
    except Exception as e:  # a stream reads its first file only now
        raise UserError(
            f"{where} cannot be read as a dataset ({_cause(e)}); point it at parquet, json/jsonl or arrow files"
        ) from None
    if first is None:
        raise UserError(f"{where} holds no rows; point it at a dataset with text")
    if column not in first:
        raise UserError(
            f"{where} has no column '{column}' (its columns: {', '.join(sorted(first))}); "
            "set data.text_column to the column holding the text"
        )
    if not isinstance(first[column], str):
        raise UserError(
            f"{where}: column '{column}' holds {type(first[column]).__name__}, not text; "
            "set data.text_column to a column of strings"
        )
    return ds.select_columns([column])


def _is_stream(ds: Any) -> bool:
    import datasets

    return isinstance(ds, datasets.IterableDataset)


def holdout_split(ds: Any, every: int, held_out: bool) -> Any:
    """Rows i with i % every == every - 1 (`held_out`), or every other row: the validation split rule."""
    if _is_stream(ds):
        return ds.filter(lambda _row, i: (i % every == every - 1) == held_out, with_indices=True)
    return ds.select([i for i in range(len(ds)) if (i % every == every - 1) == held_out])


def rank_slice(ds: Any, rank: int, world_size: int, where: str) -> Any:
    """This data-parallel rank's part of `ds` (see the module docstring)."""
    if world_size == 1:
        return ds
    if _is_stream(ds):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(ds, rank=rank, world_size=world_size)
    if len(ds) < world_size:
        raise UserError(
            f"{where} has {len(ds)} rows for {world_size} data-parallel ranks; every rank needs at least one row"
        )
    return ds.shard(num_shards=world_size, index=rank, contiguous=True)


class SequentialPackedLoader:
    """Endless iterator of `{"input": LongTensor[B, S], "labels": LongTensor[B, S]}`, packed in the rows' order, plus
    their `document_ids` (graph_trainer.data.packing) with `document_ids`.

    `rows(start, epoch)` yields the texts of this rank's slice from row `start` on, in pass `epoch`'s order. The
    position and resume rules are the module docstring's. `epoch` is the pass the most recent batch ended in.
    """

    def __init__(
        self,
        rows: Rows,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        seq_len: int,
        data_rank: int = 0,
        data_size: int = 1,
        gather: Gather | None = None,
        where: str = "data.path",
        document_ids: bool = False,
    ) -> None:
        self.rows, self.tokenizer, self.document_ids = rows, tokenizer, document_ids
        self.batch_size, self.seq_len = batch_size, seq_len
        self.data_rank, self.data_size, self.gather, self.where = data_rank, data_size, gather, where
        self.epoch, self.doc, self.token = 0, 0, 0
        self._texts: Iterator[str] | None = None  # rows from `doc` on (from `doc + 1` once `_ids` holds `doc`)
        self._ids: torch.Tensor | None = None  # the ids of row `doc`, EOS included, while it is being read
        self._pass_from, self._pass_has_text = 0, False  # where the open pass started; whether it gave text

    def __iter__(self) -> SequentialPackedLoader:
        return self

    def _row_ids(self, text: str) -> torch.Tensor:
        ids = self.tokenizer.encode_to_tensor(text)
        if ids.numel() and self.tokenizer.eos_id is not None:
            ids = torch.cat([ids, torch.tensor([self.tokenizer.eos_id], dtype=torch.int32)])
        return ids

    def _current_row(self) -> torch.Tensor:
        """The ids of row `doc` (moving to the next pass at the end of the slice)."""
        while self._ids is None:
            if self._texts is None:
                self._texts, self._pass_from, self._pass_has_text = self.rows(self.doc, self.epoch), self.doc, False
            text = next(self._texts, None)
            if text is None:
                if self._pass_from == 0 and not self._pass_has_text:  # a whole pass gave no token: never will
                    raise UserError(
                        f"{self.where} has no text for data-parallel rank {self.data_rank} (0 tokens); "
                        "check data.text_column, or use fewer ranks"
                    )
                self.epoch, self.doc, self.token, self._texts = self.epoch + 1, 0, 0, None
                continue
            ids = self._row_ids(text)
            if ids.numel() == 0:
                self.doc += 1  # an empty row adds nothing, not even EOS (as the other sources)
                continue
            self._pass_has_text, self._ids = True, ids
        return self._ids

    def __next__(self) -> dict[str, torch.Tensor]:
        need = self.batch_size * (self.seq_len + 1)
        pieces, have = [], 0  # each piece is (part of) one row: one document
        while have < need:
            ids = self._current_row()
            take = min(need - have, ids.numel() - self.token)
            pieces.append(ids[self.token : self.token + take])
            have += take
            self.token += take
            if self.token == ids.numel():
                self.doc, self.token, self._ids = self.doc + 1, 0, None
        windows = torch.cat(pieces).view(self.batch_size, self.seq_len + 1)
        if not self.document_ids:
            return packed_batch(windows)
        lengths = torch.tensor([p.numel() for p in pieces])
        return packed_batch(windows, torch.arange(len(pieces)).repeat_interleave(lengths).view_as(windows))

    def position(self) -> dict[str, int]:
        """This rank's position: the pass, the row and the token in it where the next window starts."""
        return {"epoch": self.epoch, "doc": self.doc, "token": self.token}

    def state_dict(self) -> dict[str, Any]:
        """Every data-parallel rank's position (a collective when there are several: every rank calls it)."""
        positions = self.gather(self.position()) if self.gather is not None else [self.position()]
        return {"data_ranks": self.data_size, "positions": positions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` of the same data on the same number of data-parallel ranks."""
        positions = state.get("positions") if isinstance(state, dict) else None
        if positions is None:
            raise UserError(
                f'the checkpoint\'s data position was not written by data.source = "{SOURCE}"; '
                "resume with the data.source it was saved with"
            )
        if len(positions) != self.data_size:
            raise UserError(
                f"the checkpoint's data positions belong to {len(positions)} data-parallel ranks, this job has "
                f"{self.data_size}: each rank reads its own slice of {self.where}, so resume on "
                f"{len(positions)} data-parallel ranks"
            )
        self.seek(positions[self.data_rank])

    def seek(self, position: dict[str, int]) -> None:
        """Make the next batch start at `position` (see `position()`)."""
        epoch, doc, token = (int(position[k]) for k in ("epoch", "doc", "token"))
        if min(epoch, doc, token) < 0:
            raise UserError(f"data loader position {position} is invalid; resume from an intact checkpoint")
        self.epoch, self.doc, self.token, self._texts, self._ids = epoch, doc, token, None, None
        if token:
            ids = self._current_row()
            if token >= ids.numel() or self.doc != doc:
                raise UserError(
                    f"the checkpoint's data position (row {doc}, token {token}) does not fit {self.where} "
                    "any more; resume with the data the checkpoint was saved with"
                )

    def rewind(self) -> None:
        """Back to the first row of the slice (validation reads the same batches every time)."""
        self.seek({"epoch": 0, "doc": 0, "token": 0})


def _in_order(ds: Any, shuffle: Shuffle | None, epoch: int) -> Any:
    """`ds` in pass `epoch`'s order: as it is, or shuffled from `(shuffle.seed, epoch)` (module docstring)."""
    if shuffle is None:
        return ds
    if _is_stream(ds):
        shuffled = ds.shuffle(seed=shuffle.seed, buffer_size=shuffle.buffer)
        shuffled.set_epoch(epoch)  # the stream's own rule: its generator is seeded with seed + epoch
        return shuffled
    # keep_in_memory: the index mapping is not written next to the data (a run touches only its own files)
    return ds.shuffle(seed=shuffle.seed + epoch, keep_in_memory=True)


def text_rows(ds: Any, column: str, shuffle: Shuffle | None = None) -> Rows:
    """`rows(start, epoch)`: the texts of `ds`'s `column` from row `start` on, in pass `epoch`'s order, read in
    blocks."""

    def rows(start: int, epoch: int) -> Iterator[str]:
        ordered = _in_order(ds, shuffle, epoch)
        # A stream re-reads the rows before `start` either way; dropping them here, not with `skip`, keeps a shuffled
        # stream's order (`skip` would freeze the order of its files and so read another sequence).
        stream = _is_stream(ds)
        part = ordered.skip(start) if start and not stream else ordered
        texts = (
            text if text is not None else "" for block in part.iter(batch_size=_READ_BATCH) for text in block[column]
        )
        yield from islice(texts, start, None) if stream else texts  # a null is an empty row

    return rows


def build_hf_loader(
    path: str,
    tokenizer: Tokenizer,
    *,
    text_column: str,
    streaming: bool,
    batch_size: int,
    seq_len: int,
    data_rank: int = 0,
    data_size: int = 1,
    gather: Gather | None = None,
    holdout: tuple[int, bool] | None = None,
    shuffle: Shuffle | None = None,
    option: str = "data.path",
    document_ids: bool = False,
) -> SequentialPackedLoader:
    """This data-parallel rank's loader over the dataset at `path`.

    `holdout` = (every, held_out) keeps only the held-out rows (True) or only the others (False) of the
    validation split rule (`holdout_split`), applied before the ranks' slices are cut. `shuffle` draws each pass's
    order of the rank's slice (None: the dataset's order). `document_ids` adds each row's document ids to the
    batches (graph_trainer.data.packing).
    """
    where = f"{option} '{path}'"
    ds = column_checked(open_dataset(path, streaming=streaming, option=option), text_column, where)
    if holdout is not None:
        ds = holdout_split(ds, *holdout)
    ds = rank_slice(ds, data_rank, data_size, where)
    loader = SequentialPackedLoader(
        text_rows(ds, text_column, shuffle),
        tokenizer,
        batch_size=batch_size,
        seq_len=seq_len,
        data_rank=data_rank,
        data_size=data_size,
        gather=gather,
        where=where,
        document_ids=document_ids,
    )
    return loader
