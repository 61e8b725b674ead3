"""Training data: document sources -> one token stream -> packed, shuffled batches.

Pipeline (everything in memory, nothing cached on disk):
1. A source yields documents (strings): `embedded` (CPython's own pydoc topics, so
   every install can train without a download), `text` files, or `jsonl` records.
   `synthetic` skips text and draws random token ids, for benchmarks.
2. Every document is tokenized and followed by EOS (when the tokenizer has one);
   the results are concatenated into one stream.
3. The stream is cut into non-overlapping windows of seq_len + 1 tokens; a sample is
   input = window[:-1], labels = window[1:].
4. `ShuffledWindows` visits the windows in a fresh seeded permutation each epoch, cut into
   global batches whose rows the data ranks share, and `packing.PackedLoader` turns them
   into resumable batches (as it does for data read with Hugging Face datasets).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from graph_trainer.data import chat
from graph_trainer.data.hf_datasets import SOURCE as HF_SOURCE
from graph_trainer.data.hf_datasets import Gather, Shuffle, build_hf_loader
from graph_trainer.data.packing import PackedLoader, Windows, document_ids_with_eos, stream_document_ids
from graph_trainer.data.tokenizer import Tokenizer
from graph_trainer.errors import ConfigError, UserError, closest_match
from graph_trainer.observability.log import get_logger

logger = get_logger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
# Synthetic data holds this many batches per rank per epoch: enough to exercise
# shuffling and epoch rollover, small enough that even 8B-sized batches stay cheap.
SYNTHETIC_BATCHES_PER_RANK = 8


# ---------------------------------------------------------------- sources


def embedded_documents() -> Iterator[str]:
    """The pydoc topic texts shipped with every CPython (~465 KB of English prose and
    code), one document per topic, in sorted key order."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


def _require_path(path: str, source: str) -> Path:
    if not path:
        raise UserError(f'data.path is empty but data.source = "{source}" reads files; set data.path')
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"data.path '{p}' does not exist; set data.path to a file or folder for data.source = \"{source}\""
        )
    return p


def _files_under(root: Path, suffixes: tuple[str, ...], source: str) -> list[Path]:
    """`root` itself if it is a file, else every matching file below it, sorted (for determinism)."""
    if root.is_file():
        return [root]
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.name.endswith(suffixes))
    if not files:
        raise UserError(
            f"data.path '{root}' holds no {'/'.join(suffixes)} files for data.source = \"{source}\"; "
            "point data.path at a folder with such files"
        )
    return files


# A file whose sample is more than this fraction undecodable or control characters is not text.
MAX_NON_TEXT_FRACTION = 0.1
_SAMPLE_CHARS = 1 << 20
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f\ufffd]")  # control characters (not tab/newlines), U+FFFD


def check_text(text: str, where: Path) -> None:
    """Refuse a file that is mostly not text (a binary given as data.source = text); warn about a few bad bytes.

    Decoding replaced each invalid UTF-8 sequence with U+FFFD. The verdict reads the first
    1 Mi characters, so it costs little on large corpora.
    """
    sample = text[:_SAMPLE_CHARS]
    bad = sum(1 for _ in _CONTROL.finditer(sample))
    if sample and bad > MAX_NON_TEXT_FRACTION * len(sample):
        raise UserError(
            f"data.path file '{where}' does not look like text: {100 * bad / len(sample):.0f}% of its "
            "first characters are invalid UTF-8 or control bytes; point data.path at UTF-8 text "
            "(data.source = text) or use data.source = synthetic"
        )
    replaced = text.count("\ufffd")
    if replaced:
        logger.warning(f"data.path file '{where}': {replaced} invalid UTF-8 sequences were replaced by U+FFFD")


def text_documents(path: str) -> Iterator[str]:
    """One document per file: `path` itself if it is a file, else every .txt/.md/.rst/.py
    file below it (recursively, sorted). Undecodable bytes become U+FFFD; a file that is
    mostly not text is refused (`check_text`)."""
    for f in _files_under(_require_path(path, "text"), TEXT_SUFFIXES, "text"):
        text = f.read_text(encoding="utf-8", errors="replace")
        check_text(text, f)
        yield text


def jsonl_documents(path: str) -> Iterator[str]:
    """One document per line, its "text" field: `path` itself if it is a file, else every
    *.jsonl file below it (recursively, sorted). Blank lines are skipped."""
    for f in _files_under(_require_path(path, "jsonl"), (".jsonl",), "jsonl"):
        with f.open(encoding="utf-8", errors="replace") as lines:
            for lineno, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{f}:{lineno}: not valid JSON ({e.msg}); "
                        "each line of a data.path .jsonl file must be one JSON object"
                    ) from e
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise UserError(
                        f'{f}:{lineno}: no string "text" field; '
                        'each line of a data.path .jsonl file must look like {"text": "..."}'
                    )
                yield text


DOCUMENT_SOURCES: dict[str, Callable[[str], Iterator[str]]] = {
    "embedded": lambda path: embedded_documents(),
    "text": text_documents,
    "jsonl": jsonl_documents,
}
CHAT_SOURCE = "chat"  # instruction rows whose answers alone count (graph_trainer.data.chat)
# The in-memory sources, then the one read with Hugging Face datasets (graph_trainer.data.hf_datasets).
SOURCES = (*sorted([*DOCUMENT_SOURCES, CHAT_SOURCE, "synthetic"]), HF_SOURCE)


def infer_source(path: str) -> str:
    """The source that reads `path` when `data.path` is given without `data.source`: "chat" for instruction rows
    (`chat.is_instruction_data`), "jsonl" for .jsonl text, "hf_datasets" for parquet, json or arrow files (or a
    folder of them), else "text" (which refuses a path that is not text in its own words)."""
    if chat.is_instruction_data(path):
        return CHAT_SOURCE
    root = Path(path).expanduser()
    suffixes = {root.suffix} if root.is_file() else {f.suffix for f in root.rglob("*") if f.is_file()}
    if root.is_dir() and any((root / m).is_file() for m in ("dataset_info.json", "state.json")):
        return HF_SOURCE
    if ".jsonl" in suffixes and suffixes <= {".jsonl"}:
        return "jsonl"
    if suffixes & {".parquet", ".json", ".arrow"}:
        return HF_SOURCE
    return "text"


def holdout_documents(documents: Iterator[str], every: int, held_out: bool) -> Iterator[str]:
    """Documents i with i % every == every - 1 (`held_out`), or all the others: the validation split rule."""
    for i, doc in enumerate(documents):
        if (i % every == every - 1) == held_out:
            yield doc


# ---------------------------------------------------------------- packing


def tokenize_documents(documents: Iterator[str], tokenizer: Tokenizer) -> torch.Tensor:
    """One int32 stream: each document's ids followed by EOS (if the tokenizer has one).
    Documents that tokenize to nothing are dropped, so no EOS follows another EOS."""
    return tokenize_documents_with_starts(documents, tokenizer)[0]


def tokenize_documents_with_starts(documents: Iterator[str], tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokenize_documents`' stream, and the offsets in it where each document (its EOS included) starts, int64."""
    pieces, starts, length = [], [], 0
    for doc in documents:
        ids = document_ids_with_eos(doc, tokenizer)
        if ids.numel() == 0:
            continue
        starts.append(length)
        pieces.append(ids)
        length += ids.numel()
    if not pieces:
        return torch.empty(0, dtype=torch.int32), torch.zeros(1, dtype=torch.long)
    return torch.cat(pieces), torch.tensor(starts, dtype=torch.long)


def synthetic_stream(vocab_size: int, num_tokens: int, seed: int) -> torch.Tensor:
    """`num_tokens` uniform random ids in [0, vocab_size), reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=gen, dtype=torch.int32)


def pack_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_windows, seq_len + 1] view of the stream; the tail shorter than a window is dropped."""
    window = seq_len + 1
    num_windows = stream.numel() // window
    return stream[: num_windows * window].view(num_windows, window)


# ---------------------------------------------------------------- loader


class ShuffledWindows:
    """The order of the in-memory sources' windows (a `WindowOrder`): epoch e visits every window once, in a
    `torch.randperm` drawn from a generator seeded with `seed + e`, cut into global batches of `batch_size x
    world_size` windows. Data rank r takes rows r * batch_size .. (r + 1) * batch_size - 1 of each, so a step's
    global batch is the same windows at any number of data ranks. A trailing partial global batch is dropped.
    `epoch` is the epoch the most recent batch came from.

    `document_starts` (the sorted stream offsets where documents start) adds the windows' document ids; `counted`
    (bool, the windows' shape) marks the tokens that count as labels (None: all of them).
    """

    name = "in-memory windows"

    def __init__(
        self,
        windows: torch.Tensor,
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        document_starts: torch.Tensor | None = None,
        counted: torch.Tensor | None = None,
    ) -> None:
        if windows.dim() != 2 or windows.shape[1] < 2:
            raise ValueError(f"windows must be [num_windows, seq_len + 1], seq_len >= 1; got {tuple(windows.shape)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.windows, self.batch_size, self.seed, self.rank, self.world_size = (
            windows,
            batch_size,
            seed,
            rank,
            world_size,
        )
        self.document_starts, self.counted = document_starts, counted
        # Same count on every rank, so collectives stay in step at epoch ends.
        self.batches_per_epoch = windows.shape[0] // batch_size // world_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{windows.shape[0]} windows do not fill one batch of {batch_size} on each of {world_size} ranks"
            )
        self.epoch = 0
        self.batch_index = 0  # global batches of `epoch` already taken
        self._perm_epoch: int | None = None
        self._perm = torch.empty(0, dtype=torch.long)

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed windows (the usable part of the stream)."""
        return self.windows.numel()

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.windows.shape[0], generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def next_windows(self) -> Windows:
        """This data rank's rows of the next global batch."""
        if self.batch_index == self.batches_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        start = (self.batch_index * self.world_size + self.rank) * self.batch_size
        idx = self._permutation(self.epoch)[start : start + self.batch_size]
        self.batch_index += 1
        counted = None if self.counted is None else self.counted[idx]
        if self.document_starts is None:
            return Windows(self.windows[idx], None, counted)
        width = self.windows.shape[1]  # window w holds the stream's tokens w * width .. (w + 1) * width - 1
        offsets = idx[:, None] * width + torch.arange(width)
        return Windows(self.windows[idx], stream_document_ids(self.document_starts, offsets), counted)

    def position(self) -> dict[str, int]:
        """The current epoch and how many of its global batches were taken (the same on every data rank)."""
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def seek(self, position: dict[str, Any] | None) -> None:
        """Continue from a `position()` (None: the first batch of epoch 0)."""
        if position is None:
            self.epoch, self.batch_index = 0, 0
            return
        if not {"epoch", "batch_index"} <= position.keys():
            raise UserError(
                f"the checkpoint's data position {sorted(position)} was not written for {self.name}; "
                "resume with the data.source it was saved with"
            )
        epoch, batch_index = int(position["epoch"]), int(position["batch_index"])
        if epoch < 0 or not 0 <= batch_index <= self.batches_per_epoch:
            raise UserError(
                f"data loader state (epoch {epoch}, batch {batch_index}) does not fit this data "
                f"({self.batches_per_epoch} batches per epoch); "
                "resume with the data and batch settings the checkpoint was saved with"
            )
        self.epoch, self.batch_index = epoch, batch_index


def build_dataloader(
    source: str,
    path: str,
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    text_column: str = "text",
    streaming: bool = False,
    gather: Gather | None = None,
    holdout: tuple[int, bool] | None = None,
    shuffle: Shuffle | None = None,
    option: str = "data.path",
    document_masking: bool = False,
    chat_template: str = "",
) -> PackedLoader:
    """Read `source` (see `SOURCES`), tokenize and pack it, and return this data rank's loader.

    `path` is ignored by "embedded" and "synthetic"; "synthetic" draws ids below
    `tokenizer.vocab_size` from `seed`. "hf_datasets" reads `text_column` of the dataset at `path`, streamed
    when `streaming`, and gathers the ranks' positions with `gather` (see `graph_trainer.data.hf_datasets`).
    `holdout` = (every, held_out) keeps only the held-out documents (True) or only the others (False) of the
    validation split rule (`holdout_documents`); `shuffle` draws each pass's row order of "hf_datasets" (the other
    sources always visit their windows in an order drawn from `seed`); `option` names `path` in messages.
    `document_masking` adds each row's document ids to the batches (graph_trainer.data.packing); synthetic tokens
    are one document. "chat" reads instruction rows (graph_trainer.data.chat), rendered with `chat_template` or the
    tokenizer folder's template.
    """
    if batch_size < 1:
        raise ConfigError(f"training.local_batch_size must be >= 1, got {batch_size}")
    if seq_len < 1:
        raise ConfigError(f"training.seq_len must be >= 1, got {seq_len}")
    if source == HF_SOURCE:
        return build_hf_loader(
            path,
            tokenizer,
            text_column=text_column,
            streaming=streaming,
            batch_size=batch_size,
            seq_len=seq_len,
            data_rank=rank,
            data_size=world_size,
            gather=gather,
            holdout=holdout,
            shuffle=shuffle,
            option=option,
            document_ids=document_masking,
        )
    if source == CHAT_SOURCE:
        return _instruction_loader(path, tokenizer, batch_size, seq_len, seed, rank, world_size, holdout, option,
                                   document_masking, chat_template)  # fmt: skip
    starts = torch.zeros(1, dtype=torch.long)
    if source == "synthetic":
        num_windows = batch_size * world_size * SYNTHETIC_BATCHES_PER_RANK
        stream = synthetic_stream(tokenizer.vocab_size, num_windows * (seq_len + 1), seed)
    elif source in DOCUMENT_SOURCES:
        documents = DOCUMENT_SOURCES[source](path)
        if holdout is not None:
            documents = holdout_documents(documents, *holdout)
        stream, starts = tokenize_documents_with_starts(documents, tokenizer)
        if stream.numel() == 0:
            raise UserError(f"{option} '{path}' has no text to train on (0 tokens); point {option} at non-empty files")
    else:
        close = closest_match(source, list(SOURCES))
        hint = f' (did you mean "{close}"?)' if close else ""
        raise ConfigError(f'data.source "{source}" is unknown{hint}; valid sources: {", ".join(SOURCES)}')

    needed = batch_size * world_size * (seq_len + 1)
    if stream.numel() < needed:
        where = "the embedded corpus" if source == "embedded" else f"{option} '{path}'"
        held_out_fix = ", a smaller validation.holdout_every" if holdout is not None and holdout[1] else ""
        if holdout is not None:
            where += f" ({'held out' if holdout[1] else 'kept'} by the validation split)"
        ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
        raise UserError(
            f"{where} has {stream.numel()} tokens but one batch needs {needed} "
            f"({batch_size} x (seq_len {seq_len} + 1){ranks}); use a smaller training.seq_len "
            f"or training.local_batch_size{held_out_fix}, or more data"
        )
    order = ShuffledWindows(
        pack_windows(stream, seq_len),
        batch_size=batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        document_starts=starts if document_masking else None,
    )
    return PackedLoader(order)


def _instruction_loader(
    path: str,
    tokenizer: Tokenizer,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int,
    world_size: int,
    holdout: tuple[int, bool] | None,
    option: str,
    document_masking: bool,
    chat_template: str,
) -> PackedLoader:
    """The loader of instruction rows: whole rows packed into windows (`chat.packed_instructions`), visited as the
    other in-memory sources visit theirs."""
    packed = chat.packed_instructions(
        path, tokenizer, seq_len, template_path=chat_template, holdout=holdout, option=option
    )
    needed = batch_size * world_size
    if packed.windows.shape[0] < needed:
        ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
        raise UserError(
            f"{option} '{path}' packs into {packed.windows.shape[0]} windows of seq_len {seq_len} + 1 tokens but one "
            f"batch needs {needed} ({batch_size}{ranks}); use a smaller training.local_batch_size or more rows"
        )
    order = ShuffledWindows(
        packed.windows,
        batch_size=batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        document_starts=packed.document_starts if document_masking else None,
        counted=packed.counted,
    )
    return PackedLoader(order)
