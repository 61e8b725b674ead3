"""Instruction and chat rows -> packed token rows in which only the answers count in the loss.

A row (a jsonl line, an object of a json list, or a parquet row) holds either
- `messages`: a list of `{"role", "content"}`, rendered with the model's chat template (the tokenizer folder's
  `chat_template.jinja`, else `chat_template` in its `tokenizer_config.json`, or `data.chat_template`); or
- `prompt` and `completion`: two strings, the completion followed by EOS.

Which tokens count is decided by the rendering, not by looking for role names in the text. For each assistant
turn i, the template renders the conversation before it with the generation prompt (`add_generation_prompt`) and
then the conversation up to and including it: the text the second adds to the first is what the model must learn
to say (the answer and the template's end-of-turn token). Every rendering must be a prefix of the whole one (a
template that rewrites earlier turns, or drops them, cannot be split this way and is refused). The rendered text
is tokenized piece by piece at those boundaries, so no token straddles a prompt and an answer.

Packing: whole rows, in file order, greedily into windows of seq_len + 1 tokens; what is left of a window is
padding (the EOS id) that counts for nothing. A row is never split across windows. A row longer than a window is
cut to it (counted in the log line); a row with no answer token left after the cut is dropped (counted too).
Each row is its own document (`packing.DOCUMENT_IDS`), so with document masking (the default for this data) a
row attends only to itself. The labels of tokens that do not count are `packing.IGNORE_LABEL`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from graph_trainer.data.tokenizer import Tokenizer
from graph_trainer.errors import UserError
from graph_trainer.observability.log import get_logger

logger = get_logger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet")
TEMPLATE_FILE = "chat_template.jinja"
# What makes a row instruction data (`is_instruction_data`): these keys in its first row.
MESSAGES, PROMPT, COMPLETION = "messages", "prompt", "completion"


@dataclass
class Row:
    """One instruction row and where it is, for messages that name it."""

    data: Any
    where: str  # "file:line" (jsonl) or "file row N"


@dataclass
class Encoded:
    """A row's tokens and, per token, whether it is one the model learns to say."""

    ids: torch.Tensor  # int32 [n]
    counted: torch.Tensor  # bool [n]


# ---------------------------------------------------------------- reading


def _files(path: Path, option: str) -> list[Path]:
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
    if not files or any(f.suffix not in SUFFIXES for f in files):
        raise UserError(f"{option} '{path}' holds no {'/'.join(SUFFIXES)} instruction rows; point it at such a file")
    return files


def _parquet_rows(f: Path) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{f} is parquet, which needs pyarrow; run: pip install 'graph_trainer[datasets]'") from None
    n = 0
    for batch in pq.ParquetFile(f).iter_batches(batch_size=256):
        for data in batch.to_pylist():
            n += 1
            yield Row(data, f"{f} row {n}")


def _json_rows(f: Path) -> Iterator[Row]:
    """A .json file holding one list of rows, or (as many .json files do) one row per line."""
    text = f.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        yield from _jsonl_rows(f)
        return
    rows = data if isinstance(data, list) else [data]
    for i, row in enumerate(rows, start=1):
        yield Row(row, f"{f} row {i}")


def _jsonl_rows(f: Path) -> Iterator[Row]:
    with f.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield Row(json.loads(line), f"{f}:{lineno}")
            except json.JSONDecodeError as e:
                raise UserError(f"{f}:{lineno}: not valid JSON ({e.msg}); write one JSON object a line") from None


def read_rows(path: str, option: str = "data.path") -> Iterator[Row]:
    """The rows of `path` (a file, or a folder of files, sorted), in order."""
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"{option} '{root}' does not exist; set {option} to a jsonl, json or parquet file")
    for f in _files(root, option):
        reader = {".parquet": _parquet_rows, ".json": _json_rows, ".jsonl": _jsonl_rows}[f.suffix]
        yield from reader(f)


def is_instruction_data(path: str) -> bool:
    """Whether `path`'s first row holds `messages`, or `prompt` and `completion` (what `data.path` alone reads as
    instruction data)."""
    root = Path(path).expanduser()
    if not root.exists() or (root.is_file() and root.suffix not in SUFFIXES):
        return False
    try:
        first = next(read_rows(path), None)
    except (UserError, OSError, UnicodeDecodeError):
        return False
    return isinstance(first.data if first else None, dict) and (
        MESSAGES in first.data or (PROMPT in first.data and COMPLETION in first.data)
    )


# ---------------------------------------------------------------- the chat template


class ChatTemplate:
    """A Hugging Face chat template (Jinja), rendered as transformers renders it: a sandboxed environment with
    `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, `raise_exception`, `strftime_now` and a `tojson`
    that keeps non-ASCII text, given `messages`, `add_generation_prompt`, and the folder's `bos_token` / `eos_token`."""

    def __init__(self, source: str, where: str, specials: dict[str, str]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.where, self.specials = where, specials
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise UserError(f"{where}: the chat template does not parse ({e}); use the model's own template") from None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template's text of `messages`."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.specials)

    @classmethod
    def find(cls, tokenizer: Tokenizer, template_path: str = "") -> ChatTemplate | None:
        """`template_path`'s template (`data.chat_template`), else the tokenizer folder's, else None."""
        folder = Path(tokenizer.path).parent if hasattr(tokenizer, "path") else None
        specials = _special_texts(folder) if folder is not None else {}
        if template_path:
            path = Path(template_path).expanduser()
            if not path.is_file():
                raise UserError(f"data.chat_template '{path}' is not a file; point it at a Jinja chat template")
            return cls(path.read_text(encoding="utf-8"), str(path), specials)
        if folder is None:
            return None
        if (folder / TEMPLATE_FILE).is_file():
            return cls((folder / TEMPLATE_FILE).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILE), specials)
        config = _read_json(folder / "tokenizer_config.json").get("chat_template")
        if isinstance(config, list):  # named templates: the default one
            config = next((t.get("template") for t in config if t.get("name") == "default"), None)
        return cls(config, str(folder / "tokenizer_config.json"), specials) if isinstance(config, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read as JSON ({e}); use the file the model was published with") from None
    return data if isinstance(data, dict) else {}


def _special_texts(folder: Path) -> dict[str, str]:
    """`bos_token` and `eos_token` as the template sees them: their text in tokenizer_config.json."""
    config = _read_json(folder / "tokenizer_config.json")
    out = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


# ---------------------------------------------------------------- encoding


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: \'messages\' is not a non-empty list; write [{{"role": ..., "content": ...}}, ...]')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {i} has no string 'role' and 'content'; write {{\"role\", \"content\"}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant turn, so nothing to learn; give each row an assistant message")
    return messages


def _answer_spans(messages: list[dict], template: ChatTemplate, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering and the character spans of its assistant turns (see the module docstring)."""
    from jinja2 import TemplateError

    try:
        whole = template.render(messages, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = template.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = template.render(messages[: i + 1], add_generation_prompt=False)
            if not (upto.startswith(before) and whole.startswith(upto)):
                raise UserError(
                    f"{where}: the chat template ({template.where}) renders turn {i} differently once later turns "
                    "follow, so the answer's tokens cannot be told apart; use a template that renders each turn once"
                )
            spans.append((len(before), len(upto)))
    except TemplateError as e:
        raise UserError(f"{where}: the chat template ({template.where}) fails to render it: {e}") from None
    return whole, spans


def _pieces(text: str, spans: list[tuple[int, int]]) -> Iterator[tuple[str, bool]]:
    at = 0
    for start, end in spans:
        if start > at:
            yield text[at:start], False
        yield text[start:end], True
        at = end
    if at < len(text):
        yield text[at:], False


def encode_row(row: Row, tokenizer: Tokenizer, template: ChatTemplate | None) -> Encoded:
    """`row`'s tokens and which of them count (see the module docstring).

    Raises:
        UserError: a missing or malformed field, no assistant turn, no template for messages, or a template that
            fails to render the row; each names the row.
    """
    data = row.data
    if not isinstance(data, dict):
        raise UserError(f"{row.where}: a row is {type(data).__name__}, not an object with 'messages' or 'prompt'")
    if MESSAGES in data:
        if template is None:
            raise UserError(
                f"{row.where}: chat messages need a chat template, and tokenizer "
                f"'{getattr(tokenizer, 'path', 'byte')}' has none beside it; set data.chat_template to a Jinja file, "
                "or give rows 'prompt' and 'completion'"
            )
        text, spans = _answer_spans(_check_messages(data[MESSAGES], row.where), template, row.where)
        pieces = list(_pieces(text, spans))
    elif isinstance(data.get(PROMPT), str) and isinstance(data.get(COMPLETION), str):
        if tokenizer.eos_id is None:
            raise UserError(f"{row.where}: a completion ends with EOS, and the tokenizer has none; use one with EOS")
        pieces = [(data[PROMPT], False), (data[COMPLETION], True)]
    else:
        fields = ", ".join(sorted(map(str, data))) or "none"
        raise UserError(
            f"{row.where}: no 'messages', nor string 'prompt' and 'completion' (its fields: {fields}); write one "
            "of the two forms"
        )
    ids, counted = [], []
    if MESSAGES not in data and tokenizer.bos_id is not None:  # a template writes its own BOS
        ids.append(torch.tensor([tokenizer.bos_id], dtype=torch.int32))
        counted.append(torch.zeros(1, dtype=torch.bool))
    for text, counts in pieces:
        piece = tokenizer.encode_to_tensor(text)
        ids.append(piece)
        counted.append(torch.full((piece.numel(),), counts, dtype=torch.bool))
    if MESSAGES not in data:
        ids.append(torch.tensor([tokenizer.eos_id], dtype=torch.int32))
        counted.append(torch.ones(1, dtype=torch.bool))
    return Encoded(torch.cat(ids), torch.cat(counted))


# ---------------------------------------------------------------- packing


@dataclass
class PackedRows:
    """Rows packed into windows of seq_len + 1 tokens (see the module docstring)."""

    windows: torch.Tensor  # int32 [N, seq_len + 1]
    counted: torch.Tensor  # bool [N, seq_len + 1]: the token is one the model learns to say
    document_starts: torch.Tensor  # int64: stream offsets (window w starts at w * (seq_len + 1)) of rows and padding
    rows: int = 0
    truncated: int = 0
    dropped: int = 0


def pack_rows(encoded: Iterator[Encoded], seq_len: int, pad_id: int) -> PackedRows:
    """Whole rows into windows, in order (see the module docstring)."""
    width = seq_len + 1
    windows, counted, starts = [], [], []
    ids = torch.full((width,), pad_id, dtype=torch.int32)
    mask = torch.zeros(width, dtype=torch.bool)
    fill = rows = truncated = dropped = 0

    def close() -> None:
        nonlocal ids, mask, fill
        if fill:
            if fill < width:
                starts.append(len(windows) * width + fill)  # the padding is a document of its own
            windows.append(ids)
            counted.append(mask)
        ids = torch.full((width,), pad_id, dtype=torch.int32)
        mask = torch.zeros(width, dtype=torch.bool)
        fill = 0

    for row in encoded:
        n = row.ids.numel()
        if n > width:
            truncated += 1
            row, n = Encoded(row.ids[:width], row.counted[:width]), width
        if not row.counted[1:].any():  # the first token is never a label: nothing of this row is learned
            dropped += 1
            continue
        if fill + n > width:
            close()
        starts.append(len(windows) * width + fill)
        ids[fill : fill + n], mask[fill : fill + n] = row.ids, row.counted
        fill += n
        rows += 1
    close()
    if not windows:
        return PackedRows(torch.empty(0, width, dtype=torch.int32), torch.empty(0, width, dtype=torch.bool),
                          torch.zeros(1, dtype=torch.long), rows, truncated, dropped)  # fmt: skip
    return PackedRows(
        torch.stack(windows), torch.stack(counted), torch.tensor(starts, dtype=torch.long), rows, truncated, dropped
    )


def packed_instructions(
    path: str,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    template_path: str = "",
    holdout: tuple[int, bool] | None = None,
    option: str = "data.path",
) -> PackedRows:
    """`path`'s rows (with `holdout` = (every, held_out), the validation split rule's rows), encoded and packed;
    says in one line what it read, what counts, and what was cut or dropped."""
    template = ChatTemplate.find(tokenizer, template_path)
    rows = read_rows(path, option)
    if holdout is not None:
        every, held_out = holdout
        rows = (r for i, r in enumerate(rows) if (i % every == every - 1) == held_out)
    pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    packed = pack_rows((encode_row(r, tokenizer, template) for r in rows), seq_len, pad)
    tokens = packed.windows.numel()
    share = 100 * packed.counted[:, 1:].sum().item() / max(1, packed.windows[:, 1:].numel())
    logger.info(
        f"instruction data {path}: {packed.rows} rows in {packed.windows.shape[0]} windows of {seq_len + 1} tokens "
        f"({tokens} tokens, {share:.1f}% of the labels count in the loss); {packed.truncated} rows cut to the window, "
        f"{packed.dropped} dropped with no answer token left"
    )
    return packed


__all__ = [
    "ChatTemplate",
    "Encoded",
    "PackedRows",
    "Row",
    "encode_row",
    "is_instruction_data",
    "pack_rows",
    "packed_instructions",
    "read_rows",
]
