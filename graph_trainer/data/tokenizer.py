"""Tokenizers: text <-> token ids.

Two implementations behind one small interface (`Tokenizer`):
- `ByteTokenizer`: UTF-8 bytes are the ids (0..255) plus BOS=256 and EOS=257. No
  files, no dependencies; the default, and what the debug configs train with.
- `HFTokenizer`: a Hugging Face `tokenizer.json` (e.g. Llama-3's), loaded with the
  optional `tokenizers` library.

`build_tokenizer(spec)` turns the `data.tokenizer` config value into one of these.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from graph_trainer.errors import UserError
from graph_trainer.observability.log import get_logger

logger = get_logger(__name__)

# Special-token spellings used by common tokenizer families, most specific first.
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
_BOS_NAMES = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        ...

    def encode_to_tensor(self, text: str) -> torch.Tensor:
        """Same ids as `encode`, as a 1-D int32 tensor (the packing fast path)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens are skipped."""
        ...


class ByteTokenizer:
    """UTF-8 byte-level tokenizer: ids 0..255 are bytes, BOS = 256, EOS = 257."""

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text` as ints (no BOS/EOS added)."""
        return list(text.encode("utf-8"))

    def encode_to_tensor(self, text: str) -> torch.Tensor:
        """UTF-8 bytes of `text` as a 1-D int32 tensor, without a Python list in between."""
        data = text.encode("utf-8")
        if not data:  # frombuffer rejects empty buffers
            return torch.empty(0, dtype=torch.int32)
        # bytearray: frombuffer warns on read-only buffers such as bytes.
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, loaded with the `tokenizers` library.

    BOS/EOS are the ones the folder declares beside the file (tokenizer_config.json's `bos_token` / `eos_token`,
    then generation_config.json's `bos_token_id` / `eos_token_id`), else looked up among common special-token
    spellings ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", ...), and None when the vocabulary has none.
    """

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise UserError(
                f"data.tokenizer '{path}' needs the 'tokenizers' library, which is not installed; "
                "run: pip install 'graph_trainer[tokenizers]' (or set data.tokenizer = \"byte\")"
            ) from e
        self.path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise UserError(
                f"data.tokenizer '{self.path}' is not a valid Hugging Face tokenizer.json ({e}); "
                "point data.tokenizer at a tokenizer.json file"
            ) from e
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        declared = _declared_specials(self.path.parent)
        self.bos_id: int | None = self._special(declared.get("bos"), _BOS_NAMES)
        self.eos_id: int | None = self._special(declared.get("eos"), _EOS_NAMES)
        # Said once: which token ends (and starts) a document in the packed batches, and where that came from.
        sources = sorted({where for _, where in declared.values()})
        how = f"from {', '.join(sources)}" if sources else "by their usual spellings"
        logger.info(f"tokenizer {self.path}: {self.vocab_size} ids, EOS {self.eos_id} and BOS {self.bos_id} ({how})")

    def _special(self, declared: tuple[int | str, str] | None, names: Sequence[str]) -> int | None:
        """The id the folder declares (an id, or a token's text), else the first of `names` in the vocabulary."""
        if declared is not None:
            value, where = declared
            token_id = value if isinstance(value, int) else self._tok.token_to_id(value)
            if token_id is None or not 0 <= token_id < self.vocab_size:
                raise UserError(
                    f"{where} names the special token {value!r}, which tokenizer {self.path} does not have; use the "
                    "files the model was published with"
                )
            return token_id
        return self._find_special(names)

    def _find_special(self, names: Sequence[str]) -> int | None:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the tokenizer's post-processor (which may add BOS) is not applied."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_to_tensor(self, text: str) -> torch.Tensor:
        """Same ids as `encode`, as a 1-D int32 tensor."""
        return torch.tensor(self.encode(text), dtype=torch.int32)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _declared_specials(folder: Path) -> dict[str, tuple[int | str, str]]:
    """ "bos" / "eos" -> (an id or a token's text, the file that says so), from a Hugging Face folder's
    tokenizer_config.json (`bos_token`, `eos_token`: the text, or {"content": text}) and, for what it leaves out,
    its generation_config.json (`bos_token_id`, `eos_token_id`: an id, or a list whose first is the document end)."""
    out: dict[str, tuple[int | str, str]] = {}
    for file, key_of in (("tokenizer_config.json", "{}_token"), ("generation_config.json", "{}_token_id")):
        path = folder / file
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError) as e:
            raise UserError(f"{path} cannot be read as JSON ({e}); use the file the model was published with") from None
        for special in ("bos", "eos"):
            value = data.get(key_of.format(special)) if isinstance(data, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            value = value[0] if isinstance(value, list) and value else value
            if special not in out and isinstance(value, (int, str)) and not isinstance(value, bool):
                out[special] = (value, str(path))
    return out


def build_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by `data.tokenizer`: "byte", or a path to a `tokenizer.json`
    (a folder holding one also works)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"data.tokenizer: no tokenizer file at '{path}'; set data.tokenizer to \"byte\" "
            "or to the path of a Hugging Face tokenizer.json"
        )
    return HFTokenizer(path)
