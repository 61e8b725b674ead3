"""Documents read with Hugging Face `datasets` (`data.source = "hf_datasets"`), packed in order.

What it reads (`data.path`): a local parquet, json/jsonl or arrow file, a folder of such files (one format,
every file below it, sorted), or a folder written by `Dataset.save_to_disk`. The text is the column
`data.text_column`. Loaded whole, the data is a memory-mapped Arrow table (`datasets` converts json and
parquet into its cache once); with `data.streaming` it is an `IterableDataset` read file by file, never held.

A step's global batch is the same sequences whatever the layout. Its G rows (data-parallel ranks x local batch x
micro-batches: fixed by `training.global_batch_size` when the layout changes) are G lanes: lane j packs its own
part of the data, one window per step, so row j of every global batch continues row j of the one before. The
data-parallel rank r of N holds rows r * G/N to (r + 1) * G/N - 1 and reads only their lanes: no rank tokenizes
another rank's documents, and a run resumed on another number of data ranks at the same global batch reads on
exactly the sequences it would have read (tensor-parallel peers read the same rows).
A loaded dataset is cut into G contiguous row ranges, one a lane (`Dataset.shard(G, j, contiguous=True)`); a
stream is split by `datasets.distributed.split_dataset_by_node` (whole files per lane when the number of files
divides by G; else each lane reads the stream and keeps every G-th row, so a rank reads it once per lane it holds).
Lanes are cut independently of the layout, so one process with local batch B reads B lanes, not one stream.

Packing, as the other sources do: each document's ids are followed by EOS and a lane's stream is cut into windows of
seq_len + 1 tokens. At the end of a lane's rows a new pass (epoch) of that lane starts from its first row, and its
stream runs on across the boundary. The rows come in the dataset's order, or with `data.shuffle` in an order drawn
per pass from `(training.seed, epoch)`: a loaded lane is permuted whole (`Dataset.shuffle`, an index mapping kept
in memory: nothing is written to the datasets cache); a stream is shuffled within a buffer of `data.shuffle_buffer`
rows, its files' order drawn too (`IterableDataset.shuffle` and `set_epoch`; when the lanes read whole files, the
files are dealt to them anew each pass). Every lane draws with the same seed, so the lanes stay disjoint. Either
order is a function of the seed and the pass alone, so a resume re-draws it and the position below still names
the same rows.

Position: per lane `(epoch, doc, token)`, the lane's next window starts at token `token` of row `doc` of its part
(in that pass's order) in pass `epoch`. Resuming re-opens the part at row `doc` (`skip`: an index for a loaded
dataset; a re-read of the rows before it for a stream) and re-tokenizes that one row, so the batches after a
resume are exactly those the run would have read. `DatasetLanes.position` gathers every lane's position from every rank
(through `gather`, a collective: every rank calls it), so a checkpoint written by one rank restores every rank,
at any data-parallel degree that divides the global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from graph_trainer.data.packing import PackedLoader, Windows, document_ids_with_eos
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
# rows(start, epoch): the texts of a lane's part of the data from row `start` on, in pass `epoch`'s order.
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


def lane_part(ds: Any, lane: int, lanes: int, where: str) -> Any:
    """Lane `lane`'s part of `ds`, of `lanes` (see the module docstring)."""
    if lanes == 1:
        return ds
    if _is_stream(ds):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(ds, rank=lane, world_size=lanes)
    if len(ds) < lanes:
        raise UserError(
            f"{where} has {len(ds)} rows for a global batch of {lanes} sequences; each sequence of the batch "
            "reads its own rows, so every one needs at least one: use more rows or a smaller batch"
        )
    return ds.shard(num_shards=lanes, index=lane, contiguous=True)


class PackedLane:
    """One row of the global batch: its part of the data (`rows`) packed in order, one window a step.

    `rows(start, epoch)` yields the texts of the lane's part from row `start` on, in pass `epoch`'s order. The
    position and resume rules are the module docstring's. `epoch` is the pass the most recent window ended in.
    """

    def __init__(self, rows: Rows, tokenizer: Tokenizer, *, seq_len: int, lane: int, where: str) -> None:
        self.rows, self.tokenizer, self.seq_len, self.lane, self.where = rows, tokenizer, seq_len, lane, where
        self.epoch, self.doc, self.token = 0, 0, 0
        self._texts: Iterator[str] | None = None  # rows from `doc` on (from `doc + 1` once `_ids` holds `doc`)
        self._ids: torch.Tensor | None = None  # the ids of row `doc`, EOS included, while it is being read
        self._pass_from, self._pass_has_text = 0, False  # where the open pass started; whether it gave text

    def _current_row(self) -> torch.Tensor:
        """The ids of row `doc` (moving to the next pass at the end of the part)."""
        while self._ids is None:
            if self._texts is None:
                self._texts, self._pass_from, self._pass_has_text = self.rows(self.doc, self.epoch), self.doc, False
            text = next(self._texts, None)
            if text is None:
                if self._pass_from == 0 and not self._pass_has_text:  # a whole pass gave no token: never will
                    raise UserError(
                        f"{self.where} has no text for sequence {self.lane} of the global batch (0 tokens in its "
                        "rows); check data.text_column, or use more rows or a smaller batch"
                    )
                self.epoch, self.doc, self.token, self._texts = self.epoch + 1, 0, 0, None
                continue
            ids = document_ids_with_eos(text, self.tokenizer)
            if ids.numel() == 0:
                self.doc += 1  # an empty row adds nothing, not even EOS (as the other sources)
                continue
            self._pass_has_text, self._ids = True, ids
        return self._ids

    def next_window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The lane's next seq_len + 1 tokens, and the document index (0, 1, ...) of each."""
        need = self.seq_len + 1
        pieces, have = [], 0  # each piece is (part of) one row: one document
        while have < need:
            ids = self._current_row()
            take = min(need - have, ids.numel() - self.token)
            pieces.append(ids[self.token : self.token + take])
            have += take
            self.token += take
            if self.token == ids.numel():
                self.doc, self.token, self._ids = self.doc + 1, 0, None
        lengths = torch.tensor([p.numel() for p in pieces])
        return torch.cat(pieces), torch.arange(len(pieces)).repeat_interleave(lengths)

    def position(self) -> dict[str, int]:
        """The lane's position: the pass, the row and the token in it where the next window starts."""
        return {"epoch": self.epoch, "doc": self.doc, "token": self.token}

    def seek(self, position: dict[str, int]) -> None:
        """Make the next window start at `position` (see `position()`)."""
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


class DatasetLanes:
    """The order of data read with Hugging Face datasets (a `WindowOrder`): row i of this data rank's batches is
    lane `first_lane + i` of the global batch's `num_lanes` (`PackedLane`), one window a step, with their document ids
    when `document_ids`."""

    name = 'the lanes of data.source = "hf_datasets"'

    def __init__(
        self,
        lanes: list[PackedLane],
        *,
        num_lanes: int,
        gather: Gather | None = None,
        where: str = "data.path",
        document_ids: bool = False,
    ) -> None:
        self.lanes, self.num_lanes, self.gather = lanes, num_lanes, gather
        self.where, self.document_ids = where, document_ids

    def next_windows(self) -> Windows:
        """Each of this data rank's lanes' next window."""
        windows, ids = zip(*(lane.next_window() for lane in self.lanes), strict=True)
        return Windows(torch.stack(windows), torch.stack(ids) if self.document_ids else None, None)

    def position(self) -> dict[str, Any]:
        """Every lane's position, from every data-parallel rank (a collective when there are several: every rank
        calls it)."""
        mine = [lane.position() for lane in self.lanes]
        positions = [p for rank in self.gather(mine) for p in rank] if self.gather is not None else mine
        return {"lanes": self.num_lanes, "positions": positions}

    def seek(self, position: dict[str, Any] | None) -> None:
        """Continue from a `position()` of the same data and global batch, on any number of data ranks (None: the
        first row of every lane)."""
        if position is None:
            for lane in self.lanes:
                lane.seek({"epoch": 0, "doc": 0, "token": 0})
            return
        positions = position.get("positions")
        if positions is None:
            raise UserError(
                f'the checkpoint\'s data position was not written by data.source = "{SOURCE}"; '
                "resume with the data.source it was saved with"
            )
        if "lanes" not in position:
            raise UserError(
                "the checkpoint's data positions were written per data-parallel rank, before each sequence of the "
                "global batch read its own rows; finish that run with the version that wrote it, or start a new "
                "job.dump_folder"
            )
        if position["lanes"] != self.num_lanes or len(positions) != self.num_lanes:
            raise UserError(
                f"the checkpoint's data positions belong to a global batch of {position['lanes']} sequences, this "
                f"job's is {self.num_lanes}: each sequence of the batch reads its own rows of {self.where}, so resume "
                "with the global batch it was saved with"
            )
        for lane in self.lanes:
            lane.seek(positions[lane.lane])


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
) -> PackedLoader:
    """This data-parallel rank's loader over the dataset at `path`: rows `data_rank * batch_size` on of a global
    batch of `batch_size * data_size` lanes (module docstring).

    `holdout` = (every, held_out) keeps only the held-out rows (True) or only the others (False) of the
    validation split rule (`holdout_split`), applied before the lanes are cut. `shuffle` draws each pass's
    order of a lane's rows (None: the dataset's order). `document_ids` adds each row's document ids to the
    batches (graph_trainer.data.packing).
    """
    where = f"{option} '{path}'"
    ds = column_checked(open_dataset(path, streaming=streaming, option=option), text_column, where)
    if holdout is not None:
        ds = holdout_split(ds, *holdout)
    num_lanes = batch_size * data_size
    if _is_stream(ds) and num_lanes > 1 and ds.num_shards % num_lanes:
        logger.warning(
            f"{where} is a stream of {ds.num_shards} file(s), which the global batch's {num_lanes} sequences do not "
            f"divide: each sequence reads the whole stream and keeps every {num_lanes}-th row, so this rank reads it "
            f"{batch_size} times; give it a number of files that {num_lanes} divides"
        )
    lanes = [
        PackedLane(text_rows(lane_part(ds, j, num_lanes, where), text_column, shuffle), tokenizer, seq_len=seq_len,
                   lane=j, where=where)
        for j in range(data_rank * batch_size, (data_rank + 1) * batch_size)
    ]  # fmt: skip
    return PackedLoader(DatasetLanes(lanes, num_lanes=num_lanes, gather=gather, where=where, document_ids=document_ids))
