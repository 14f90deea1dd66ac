"""Prepared corpora: text tokenized once, on disk, as memory-mapped token shards and a manifest.

``p2ptrain data prepare SOURCE... --out DIR`` writes::

    DIR/manifest.json       what the shards hold: tokenizer, dtype, shards, token count, content hash
    DIR/tokenizer.json      the BPE tokenizer (``tokenizers``' format); absent for the byte-level one
    DIR/tokens-00000.bin    tokens, raw little-endian (uint8 for 256 ids, uint16 up to 65,536, else uint32)

A peer trains on it with ``data.source: prepared`` and ``data.path: DIR``: it reads windows straight from the
memory map (``data.Tokens``), so a corpus larger than RAM trains with flat memory. The manifest's ``sha256``
covers the tokenizer and every token in order: it is the data's identity in the config hash, so two peers
agree on their data exactly when they prepared the same tokens, wherever each keeps them.

Sources: text files (read as UTF-8, in 1 MB pieces cut at line ends, so a file larger than RAM prepares too), folders
(every file under them, by name, hidden ones skipped), globs, JSONL files (``.jsonl``: one JSON object per
line, its text in ``--text-field``), Parquet files (``.parquet``: a row per document, its text in the column
``--text-field``) and Hugging Face datasets saved on disk (``Dataset.save_to_disk``: the folder, or one split
of a saved ``DatasetDict``, ``--split``); Parquet and datasets are read a record batch at a time with
``pyarrow``, without the ``datasets`` package. Documents are joined by the end-of-text token (BPE) or a
newline (bytes).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "p2ptrain-tokens/1"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
STAGING = ".preparing"
"""Where `prepare` writes a corpus before it replaces the folder's (removed when it ends)."""
END_OF_TEXT = "<|endoftext|>"
DEFAULT_SHARD_TOKENS = 1 << 27
"""Tokens per shard file (128 Mi: 256 MB of uint16)."""
_PIECE_BYTES = 1 << 20  # text files are read and tokenized 1 MB at a time
_BATCH_BYTES = 1 << 23  # texts are tokenized in batches of about 8 MB (tokenizers parallelizes a batch)


class PrepareError(ValueError):
    """A source, tokenizer or prepared folder that cannot be used; the message names it."""


class NotUTF8(PrepareError):
    def __init__(self, path: Path, offset: int):
        super().__init__(f"source {path}: not UTF-8 text (byte {offset})")
        self.offset = offset


def file_sha256(path: Path) -> str:
    """A file's sha256 (hex), read in 1 MB pieces; cached on its size and mtime, so that a rewritten file is
    read again. Data identities are built from it (``data.corpus_digest``, ``images.images_digest``)."""
    path = path.resolve()
    stat = path.stat()
    return _file_sha256(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def not_utf8_at(path: Path) -> int | None:
    """The offset of the first byte of a text file that is not UTF-8, or None when it is all text (a byte
    corpus trains on anything, but a binary file given as text is a mistake). Read in pieces; cached on the
    file's size and mtime, as :func:`file_sha256` is."""
    path = path.resolve()
    stat = path.stat()
    return _not_utf8_at(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _not_utf8_at(path: Path, size: int, mtime_ns: int) -> int | None:
    try:
        for _ in _text_pieces(path):
            pass
    except NotUTF8 as e:
        return e.offset
    return None


# ------------------------------------------------------------------------------------------ sources


@dataclass(frozen=True)
class Source:
    """One file (or saved dataset) to read documents from."""

    path: Path
    kind: str
    """'text', 'jsonl', 'parquet' or 'dataset' (a Hugging Face dataset saved on disk: its folder)."""

    def size(self) -> int:
        """Bytes on disk (for the progress bar)."""
        if self.kind == "dataset":
            return sum(p.stat().st_size for p in _dataset_files(self.path))
        return self.path.stat().st_size


SUFFIX_KINDS = {".jsonl": "jsonl", ".parquet": "parquet"}


def expand_sources(specs: Iterable[str], split: str = "train", out: Path | None = None) -> list[Source]:
    """Files, folders (recursively, sorted, hidden files skipped), globs and saved Hugging Face datasets (of a
    ``DatasetDict``, its ``split``), in the order given; never what a prepare writes in ``out`` (its
    manifest, token shards and tokenizer: an earlier run's, in a source folder that holds ``out``, are no
    text to read)."""
    found: list[Source] = []
    for spec in specs:
        try:
            found += _expand(spec, split)
        except OSError as e:  # a name too long, a folder we may not enter
            raise PrepareError(f"source {spec}: cannot read it ({e.strerror or e})") from None
    if out is not None:
        try:
            written = out.resolve()
        except (OSError, RuntimeError):  # a symlink loop: nothing a prepare wrote can be in it
            written = None
        if written is not None:
            found = [s for s in found if not _written_by_prepare(s.path, written)]
    if not found:
        raise PrepareError(
            "no sources: give text files, folders, globs, .jsonl or .parquet files, or datasets"
        )
    return found


def _written_by_prepare(path: Path, written: Path) -> bool:
    """Whether ``path`` is one of the files a prepare writes in the (resolved) output folder ``written``."""
    try:
        folder = path.parent.resolve()
    except (OSError, RuntimeError):  # a symlink loop: nothing a prepare wrote
        return False
    ours = path.name in (MANIFEST, TOKENIZER_FILE) or re.fullmatch(r"tokens-\d+\.bin", path.name) is not None
    return (folder == written and ours) or folder.is_relative_to(written / STAGING)


def _expand(spec: str, split: str) -> list[Source]:
    """One source argument's sources (:func:`expand_sources`)."""
    path = Path(spec)
    if (path / "state.json").is_file():  # Dataset.save_to_disk
        return [Source(path, "dataset")]
    if (path / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk: one folder per split
        splits = _dataset_splits(path)
        if split not in splits:
            raise PrepareError(
                f"source {spec}: a saved DatasetDict without split {split!r} (it has {splits})"
            )
        return [Source(path / split, "dataset")]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise PrepareError(f"source {spec}: the folder holds no files")
    elif path.is_file():
        files = [path]
    elif glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise PrepareError(f"source {spec}: the pattern matches no file")
    else:
        raise PrepareError(f"source {spec}: no such file or folder")
    return [Source(p, SUFFIX_KINDS.get(p.suffix, "text")) for p in files]


def documents(source: Source, text_field: str = "text") -> Iterator[Iterable[str]]:
    """A source's documents, each as its pieces: a text file is one document, read lazily in pieces."""
    if source.kind == "jsonl":
        yield from _jsonl_documents(source.path, text_field)
    elif source.kind in ("parquet", "dataset"):
        yield from _arrow_documents(source, text_field)
    else:
        yield _text_pieces(source.path)


def _text_pieces(path: Path) -> Iterator[str]:
    """A text file in pieces of about ``_PIECE_BYTES``, each cut after a line end (or, in a line longer than
    that, before an incomplete UTF-8 sequence), so that no piece splits a character."""
    offset = 0
    rest = b""
    with path.open("rb") as f:
        while chunk := f.read(_PIECE_BYTES):
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            piece, rest = (data[:cut], data[cut:]) if cut else _split_utf8(data)
            if piece:
                yield _utf8(piece, path, offset)
                offset += len(piece)
    if rest:
        yield _utf8(rest, path, offset)


def _split_utf8(data: bytes) -> tuple[bytes, bytes]:
    """Cut ``data`` before a trailing incomplete UTF-8 sequence (at most 3 bytes)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte or ASCII: the sequence starts here
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return (data, b"") if need <= back else (data[:-back], data[-back:])
    return data, b""


def _utf8(data: bytes, path: Path, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotUTF8(path, offset + e.start) from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[Iterable[str]]:
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise PrepareError(f"source {path}:{number}: not a JSON object") from None
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise PrepareError(f"source {path}:{number}: no string field {text_field!r}")
            # A JSON escape can spell a lone surrogate, which is no text: it encodes to nothing.
            if b"\\u" in line:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise PrepareError(
                        f"source {path}:{number}: field {text_field!r} holds a lone surrogate "
                        f"({ascii(e.object[e.start])} at character {e.start}), which is not text"
                    ) from None
            yield [text]


def _dataset_splits(path: Path) -> list[str]:
    try:
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
    except (ValueError, KeyError, TypeError):
        raise PrepareError(f"source {path}: dataset_dict.json does not list the splits") from None
    return [str(s) for s in splits]


def _dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a saved Dataset, in order (its state.json lists them)."""
    try:
        files = [
            path / str(f["filename"]) for f in json.loads((path / "state.json").read_text())["_data_files"]
        ]
    except (ValueError, KeyError, TypeError):
        raise PrepareError(f"source {path}: state.json does not list the dataset's data files") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise PrepareError(f"source {path}: the saved dataset lacks {', '.join(missing)}")
    return files


def _arrow_documents(source: Source, text_field: str) -> Iterator[Iterable[str]]:
    """The rows of a Parquet file or a saved dataset's Arrow files, a record batch at a time (flat memory):
    each row's ``text_field`` is a document; a null one is skipped (no text)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(
            f"source {source.path}: Parquet files and saved datasets are read with pyarrow: "
            "pip install 'p2ptrain[parquet]'"
        ) from None

    def batches() -> Iterator[tuple[Path, Any]]:
        if source.kind == "parquet":
            try:
                parquet = pq.ParquetFile(source.path)
            except (pa.ArrowException, OSError) as e:
                raise PrepareError(f"source {source.path}: not a Parquet file ({e})") from None
            _check_column(source.path, parquet.schema_arrow, text_field, pa)
            for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
                yield source.path, batch
            return
        for path in _dataset_files(source.path):
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(path)))
            except (pa.ArrowException, OSError) as e:
                raise PrepareError(f"source {path}: not an Arrow stream of a saved dataset ({e})") from None
            _check_column(path, reader.schema, text_field, pa)
            for batch in reader:
                yield path, batch

    for _, batch in batches():
        for text in batch.column(text_field).to_pylist():
            if text is not None:
                yield [text]


def _check_column(path: Path, schema: Any, text_field: str, pa: Any) -> None:
    if text_field not in schema.names:
        raise PrepareError(
            f"source {path}: no column {text_field!r} (it has {', '.join(schema.names)}); --text-field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise PrepareError(f"source {path}: column {text_field!r} holds {kind}, not text")


# ------------------------------------------------------------------------------------------ tokenizers


class Tokenizer:
    """Text to token ids. ``kind`` 'byte' (UTF-8 bytes, 256 ids) or 'bpe' (a ``tokenizers`` tokenizer)."""

    def __init__(self, kind: str, vocab_size: int, end_of_text: int | None, bpe: Any = None):
        self.kind, self.vocab_size, self.end_of_text, self._bpe = kind, vocab_size, end_of_text, bpe

    @classmethod
    def byte_level(cls) -> Tokenizer:
        return cls("byte", 256, None)

    @classmethod
    def from_file(cls, path: Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            bpe = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise PrepareError(f"tokenizer {path}: not a tokenizers tokenizer.json ({e})") from None
        # Its ids, not their count: a tokenizer.json may leave ids unused, and every id must fit the model.
        ids = bpe.get_vocab().values()
        vocab_size = max(bpe.get_vocab_size(), max(ids, default=-1) + 1)
        if not 0 < vocab_size <= MAX_VOCAB:
            raise PrepareError(f"tokenizer {path}: {vocab_size} ids; a model here takes 1 to {MAX_VOCAB}")
        return cls("bpe", vocab_size, bpe.token_to_id(END_OF_TEXT), bpe)

    @classmethod
    def train_bpe(cls, texts: Iterator[str], vocab_size: int) -> Tokenizer:
        """A byte-level BPE (GPT-2's kind: no unknown token, any text encodes) learnt from ``texts``."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        bpe = HFTokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        bpe.train_from_iterator(texts, trainer)
        return cls("bpe", bpe.get_vocab_size(), bpe.token_to_id(END_OF_TEXT), bpe)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self._bpe is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        # encode_batch_fast skips the offsets (tokenizers >= 0.20), which are not kept: a fifth faster.
        encode = getattr(self._bpe, "encode_batch_fast", self._bpe.encode_batch)
        return [np.asarray(e.ids, dtype=np.int64) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        if self._bpe is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._bpe.decode(ids)

    @functools.cached_property
    def separator(self) -> np.ndarray:
        """What joins two documents: the end-of-text token, or a newline (a byte, or as a tokenizer.json without
        that token encodes it: its id 10 is some other token)."""
        if self.end_of_text is not None:
            return np.asarray([self.end_of_text], dtype=np.int64)
        newline = self.encode_batch(["\n"])[0].astype(np.int64)
        if not len(newline):
            raise PrepareError(
                f"the tokenizer has no {END_OF_TEXT} and encodes a newline to nothing: documents would run together"
            )
        return newline

    def to_json(self) -> str | None:
        return None if self._bpe is None else self._bpe.to_str()


MAX_VOCAB = 1 << 24
"""The largest vocabulary a prepared corpus (and a model file) may have: 16.7M ids, 64x the largest in use."""


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# ------------------------------------------------------------------------------------------ the manifest


@dataclass
class Manifest:
    format: str
    tokenizer: str
    """'byte' or 'bpe'."""
    vocab_size: int
    end_of_text: int | None
    dtype: str
    num_tokens: int
    documents: int
    shards: list[dict[str, Any]]
    """Each: {"file": name in the folder, "tokens": count}, in order."""
    sources: list[str]
    sha256: str
    """Of the tokenizer (its JSON, or 'byte') and the tokens' bytes, in order: the data's identity."""
    tokenizer_sha256: str | None = None

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of a prepared folder, checked against its files (sizes, not contents)."""
        path = folder / MANIFEST
        if not path.is_file():
            raise PrepareError(
                f"{folder}: no {MANIFEST}; prepare it with `p2ptrain data prepare ... --out {folder}`"
            )
        try:
            doc = json.loads(path.read_text())
            manifest = cls(**doc)
            if manifest.format == FORMAT:  # a newer format's fields are its own business: said below
                manifest._check_fields()
        except (ValueError, TypeError, KeyError) as e:
            raise PrepareError(f"{path}: not a p2ptrain manifest ({e})") from None
        if manifest.format != FORMAT:
            raise PrepareError(f"{path}: format {manifest.format!r}, this p2ptrain reads {FORMAT!r}")
        itemsize = np.dtype(manifest.dtype).itemsize
        for shard in manifest.shards:
            file = folder / shard["file"]
            expected = shard["tokens"] * itemsize
            if not file.is_file() or file.stat().st_size != expected:
                raise PrepareError(
                    f"{file}: missing or not {expected} bytes as the manifest says; prepare again"
                )
        if sum(s["tokens"] for s in manifest.shards) != manifest.num_tokens:
            raise PrepareError(f"{path}: num_tokens does not match its shards")
        if manifest.tokenizer == "bpe" and not (folder / TOKENIZER_FILE).is_file():
            raise PrepareError(f"{folder}: no {TOKENIZER_FILE} for its BPE tokens")
        return manifest

    def _check_fields(self) -> None:
        """The fields' types, and a dtype that holds the vocabulary: ValueError or TypeError naming the field."""
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
        if not (whole(self.vocab_size) and 0 < self.vocab_size <= MAX_VOCAB):
            raise ValueError(f"vocab_size {self.vocab_size!r}: not a whole number from 1 to {MAX_VOCAB}")
        if self.end_of_text is not None and not (
            whole(self.end_of_text) and self.end_of_text < self.vocab_size
        ):
            raise ValueError(
                f"end_of_text {self.end_of_text!r}: not a token id below vocab_size {self.vocab_size}"
            )
        if not whole(self.num_tokens):
            raise ValueError(f"num_tokens {self.num_tokens!r}: not a whole number")
        if not isinstance(self.dtype, str) or self.dtype != dtype_for(self.vocab_size).name:
            raise ValueError(
                f"dtype {self.dtype!r}: {dtype_for(self.vocab_size).name} holds {self.vocab_size} ids"
            )
        if not isinstance(self.shards, list):
            raise ValueError(f"shards {self.shards!r}: not a list")
        for shard in self.shards:
            if not (
                isinstance(shard, dict) and isinstance(shard.get("file"), str) and whole(shard.get("tokens"))
            ):
                raise ValueError(f"shard {shard!r}: not a file name and a token count")
            if Path(shard["file"]).name != shard["file"]:
                raise ValueError(f"shard file {shard['file']!r}: not a name in the folder")

    def write(self, folder: Path) -> None:
        tmp = folder / (MANIFEST + ".tmp")
        _write_synced(tmp, json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, folder / MANIFEST)
        _sync_folder(folder)


def _write_synced(path: Path, text: str) -> None:
    """Write ``path`` and fsync it: on disk before anything that names it is (a manifest, its shards)."""
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_folder(folder: Path) -> None:
    """fsync a folder, so that the renames into it survive a power loss (where the system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------ preparing


def prepare(
    specs: list[str],
    out: Path,
    *,
    tokenizer: str = "byte",
    vocab_size: int = 8192,
    text_field: str = "text",
    split: str = "train",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Tokenize ``specs`` into ``out`` (see the module doc). ``tokenizer``: 'byte', 'bpe' (trained here on the
    sources, ``vocab_size`` ids) or a path to a tokenizer.json. ``progress`` is called with bytes read."""
    sources = expand_sources(specs, split, out)
    if tokenizer == "byte":
        tok = Tokenizer.byte_level()
    elif tokenizer == "bpe":
        if not 257 <= vocab_size <= 1 << 20:
            raise PrepareError(f"vocab size {vocab_size}: give 257 to 1048576")
        tok = Tokenizer.train_bpe((text for text, _ in _texts(sources, text_field)), vocab_size)
    elif Path(tokenizer).is_file():
        tok = Tokenizer.from_file(Path(tokenizer))
    else:
        raise PrepareError(f"tokenizer {tokenizer}: give 'byte', 'bpe' or a tokenizer.json file")
    if shard_tokens < 1:
        raise PrepareError(f"shard tokens {shard_tokens}: give at least 1")

    out.mkdir(parents=True, exist_ok=True)
    # Written aside and moved in once whole: a source that fails halfway leaves the folder's corpus as it was.
    staging = out / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    dtype = dtype_for(tok.vocab_size)
    tokenizer_json = tok.to_json()
    identity = hashlib.sha256((tokenizer_json or "byte").encode())
    writer = _ShardWriter(staging, dtype, shard_tokens, identity)
    count = text_tokens = 0
    try:
        if tokenizer_json is not None:
            _write_synced(staging / TOKENIZER_FILE, tokenizer_json)
        for batch in _batches(sources, text_field, progress):
            for ids, (_, ends_document) in zip(tok.encode_batch([text for text, _ in batch]), batch):
                writer.write(ids)
                text_tokens += len(ids)
                if ends_document:
                    writer.write(tok.separator)
                    count += 1
        shards = writer.close()
        if text_tokens == 0:  # separators alone (empty files) are no corpus
            raise PrepareError("the sources hold no text")
    except BaseException:
        writer.abandon()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest = Manifest(
        format=FORMAT,
        tokenizer=tok.kind,
        vocab_size=tok.vocab_size,
        end_of_text=tok.end_of_text,
        dtype=dtype.name,
        num_tokens=sum(s["tokens"] for s in shards),
        documents=count,
        shards=shards,
        sources=[str(s.path) for s in sources],
        sha256=identity.hexdigest(),
        tokenizer_sha256=None
        if tokenizer_json is None
        else hashlib.sha256(tokenizer_json.encode()).hexdigest(),
    )
    # The old manifest goes first: a folder caught between two corpora says "prepare again", never reads as one.
    (out / MANIFEST).unlink(missing_ok=True)
    for stale in [*out.glob("tokens-*.bin"), out / TOKENIZER_FILE]:
        stale.unlink(missing_ok=True)
    for made in staging.iterdir():
        os.replace(made, out / made.name)
    staging.rmdir()
    _sync_folder(out)
    manifest.write(out)
    return manifest


def _texts(sources: list[Source], text_field: str) -> Iterator[tuple[str, bool]]:
    """Every text in order, with whether it ends its document (a separator follows it)."""
    for source in sources:
        try:
            for pieces in documents(source, text_field):
                last = None
                for piece in pieces:
                    if last is not None:
                        yield last, False
                    last = piece
                yield last or "", True
        except OSError as e:  # a device that fails, a file gone meanwhile: say which source
            raise PrepareError(f"source {source.path}: cannot read it ({e.strerror or e})") from None


def _batches(
    sources: list[Source], text_field: str, progress: Callable[[int], None] | None
) -> Iterator[list[tuple[str, bool]]]:
    """:func:`_texts` in batches of about ``_BATCH_BYTES``: many short documents (JSONL rows) or a few pieces of
    a long one, which tokenizers encodes on all cores at once."""
    batch: list[tuple[str, bool]] = []
    size = 0
    for item in _texts(sources, text_field):
        batch.append(item)
        size += len(item[0])
        if size >= _BATCH_BYTES:
            yield batch
            if progress:
                progress(size)
            batch, size = [], 0
    if batch:
        yield batch
        if progress:
            progress(size)


class _ShardWriter:
    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, digest: Any):
        self.folder, self.dtype, self.shard_tokens, self.digest = folder, dtype, shard_tokens, digest
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None
        self._in_file = 0

    def write(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype.newbyteorder("<"), copy=False)
        while len(data):
            if self._file is None or self._in_file == self.shard_tokens:
                self._next()
            take = min(len(data), self.shard_tokens - self._in_file)
            chunk = data[:take].tobytes()
            self._file.write(chunk)
            self.digest.update(chunk)
            self._in_file += take
            self.shards[-1]["tokens"] = self._in_file
            data = data[take:]

    def _next(self) -> None:
        self._close()
        name = f"tokens-{len(self.shards):05d}.bin"
        self._file = (self.folder / name).open("wb")
        self._in_file = 0
        self.shards.append({"file": name, "tokens": 0})

    def _close(self) -> None:
        # A shard is on disk before the manifest that names it (a power loss would leave one of the right size,
        # full of zeros, that the manifest's size check passes).
        if self._file is not None and not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def close(self) -> list[dict[str, Any]]:
        self._close()
        return self.shards

    def abandon(self) -> None:
        """Close without syncing (the shards are thrown away, and a full disk would only fail again)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
