"""Corpora of tokens and each peer's shard of them (labelled images, the other kind of data: ``images.py``).

A corpus is Python's documentation or a text file, read into memory as bytes (one token per byte), or a
folder that ``p2ptrain data prepare`` wrote (``prepare.py``): token shards on disk, read through a memory map
window by window, so that a corpus larger than RAM trains with flat memory.

The corpus is split once, deterministically: the last ``val_fraction`` of its tokens is validation.
Training windows start at multiples of the context length (plus a per-round offset, so that the
model sees every alignment over time). Each round, every peer computes the same seeded permutation
of those windows and takes the slice of its rank in the round's roster of peers (``shards.py``): no two
peers of a round train on the same window, and nobody has to send anybody an index.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from p2ptrain.prepare import Manifest, file_sha256
from p2ptrain.shards import generator, shard_windows

if TYPE_CHECKING:
    from p2ptrain.images import ImageSet


class DataSource(Protocol):
    """Where the corpus comes from (``config.DataConfig``; config.py hashes corpora with this module)."""

    @property
    def source(self) -> str: ...
    @property
    def path(self) -> Path | None: ...


IMAGE_SOURCES = ("digits", "idx", "images")


def open_corpus(cfg: DataSource, context_length: int, val_fraction: float) -> Corpus | ImageSet:
    """The configured data, split for training: a corpus of tokens (``data.source``: pydoc, text or prepared)
    or a set of labelled images (digits, idx or images). Both answer the trainer alike (``shard``, ``batches``,
    ``val_batches``, ``model_args``)."""
    if cfg.source in IMAGE_SOURCES:
        from p2ptrain.images import open_images  # torch and numpy only until then: PIL, scikit-learn

        return open_images(cfg.source, cfg.path, val_fraction)
    if cfg.source == "prepared":
        assert cfg.path is not None  # enforced by DataConfig
        return Corpus.from_prepared(Path(cfg.path), context_length, val_fraction)
    return Corpus.from_bytes(load_corpus(cfg), context_length, val_fraction)


def load_corpus(cfg: DataSource) -> bytes:
    """The corpus as bytes: Python's own documentation topics, or the user's text file."""
    if cfg.source == "prepared" or cfg.source in IMAGE_SOURCES:
        raise ValueError(f"data.source {cfg.source!r} is read by open_corpus")
    if cfg.source == "pydoc":
        return _pydoc_bytes()
    assert cfg.path is not None  # enforced by DataConfig
    data = Path(cfg.path).read_bytes()
    if not data:
        raise ValueError(f"data.path: {cfg.path} is empty")
    return data


def _pydoc_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


def corpus_digest(cfg: DataSource) -> str:
    """The corpus's identity: a sha256 of its bytes (hex). Two peers agree on their data only if this agrees,
    whatever path each gave; a file that changes under the same path gets a new digest."""
    if cfg.source == "pydoc":
        return _pydoc_digest()
    if cfg.source in IMAGE_SOURCES:
        from p2ptrain.images import images_digest

        return images_digest(cfg.source, cfg.path)
    assert cfg.path is not None  # enforced by DataConfig
    if cfg.source == "prepared":  # hashed when prepared: the tokenizer and every token
        return Manifest.read(Path(cfg.path)).sha256
    return file_sha256(Path(cfg.path))


@functools.lru_cache(maxsize=1)
def _pydoc_digest() -> str:
    return hashlib.sha256(_pydoc_bytes()).hexdigest()


class Tokens:
    """A sequence of token ids kept in pieces (a buffer of bytes, or memory-mapped shard files), read a few
    windows at a time: nothing is copied but the windows asked for."""

    def __init__(self, pieces: Sequence[np.ndarray]):
        self.pieces = [p for p in pieces if len(p)]
        self.bounds = np.cumsum([0, *(len(p) for p in self.pieces)])

    def __len__(self) -> int:
        return int(self.bounds[-1])

    def view(self, start: int, stop: int) -> Tokens:
        """Tokens [start, stop) as a new sequence over the same memory (no copy)."""
        pieces = []
        for piece, lo in zip(self.pieces, self.bounds[:-1]):
            a, b = max(start - lo, 0), min(stop - lo, len(piece))
            if a < b:
                pieces.append(piece[a:b])
        return Tokens(pieces)

    def rows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """Windows ``[s, s + length)`` for each start, as an int64 tensor (len(starts), length)."""
        starts_np = starts.numpy().astype(np.int64)
        if len(starts_np) and (starts_np.min() < 0 or starts_np.max() + length > len(self)):
            raise IndexError(
                f"a window of {length} tokens at {starts_np.max()} is outside {len(self)} tokens"
            )
        out = np.empty((len(starts_np), length), dtype=np.int64)
        which = np.searchsorted(self.bounds, starts_np, side="right") - 1
        offsets = np.arange(length)
        for k in np.unique(which):
            rows = np.flatnonzero(which == k)
            local = starts_np[rows] - self.bounds[k]
            inside = local + length <= len(self.pieces[k])
            out[rows[inside]] = self.pieces[k][local[inside, None] + offsets]  # one gather, no Python loop
            for row in rows[~inside]:  # a window across two shards: rare
                s = int(starts_np[row])
                out[row] = np.concatenate(self.view(s, s + length).pieces)
        return torch.from_numpy(out)

    def tensor(self) -> torch.Tensor:
        """All of it, copied into memory (for small corpora and tests)."""
        return torch.from_numpy(np.concatenate(self.pieces).astype(np.int64))


@dataclass
class Corpus:
    train: Tokens
    val: Tokens
    context_length: int
    vocab_size: int = 256

    @classmethod
    def from_bytes(cls, data: bytes, context_length: int, val_fraction: float) -> Corpus:
        return cls.split(Tokens([np.frombuffer(data, dtype=np.uint8)]), context_length, val_fraction, 256)

    @classmethod
    def from_prepared(cls, folder: Path, context_length: int, val_fraction: float) -> Corpus:
        """A prepared folder (``p2ptrain data prepare``), its shards memory-mapped, read-only."""
        manifest = Manifest.read(folder)
        maps = [
            np.memmap(folder / str(s["file"]), dtype=np.dtype(manifest.dtype).newbyteorder("<"), mode="r")
            for s in manifest.shards
            if int(s["tokens"]) > 0
        ]
        return cls.split(Tokens(maps), context_length, val_fraction, manifest.vocab_size)

    @classmethod
    def split(cls, tokens: Tokens, context_length: int, val_fraction: float, vocab_size: int) -> Corpus:
        n_val = max(int(len(tokens) * val_fraction), context_length + 1)
        if len(tokens) - n_val < 2 * (context_length + 1):
            raise ValueError(
                f"the corpus has {len(tokens)} tokens: too small for model.context_length {context_length}"
            )
        n_train = len(tokens) - n_val
        return cls(
            train=tokens.view(0, n_train),
            val=tokens.view(n_train, len(tokens)),
            context_length=context_length,
            vocab_size=vocab_size,
        )

    def model_args(self) -> dict:
        """What the model's shape follows from the data (``models.build_model``): the vocabulary."""
        return {"vocab_size": self.vocab_size}

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One training batch of the first windows (for the device benchmark)."""
        starts = torch.arange(batch_size) % self.num_train_windows() * self.context_length
        return next(self.batches(starts, batch_size))

    def num_train_windows(self) -> int:
        # Windows are context_length + 1 tokens (inputs and the next-token targets); the offset can add up to
        # context_length - 1, hence the -1 window.
        return (len(self.train) - 1) // self.context_length - 1

    def shard(self, *, seed: int, round: int, rank: int, world: int) -> torch.Tensor:
        """Window start offsets of this peer's shard for one round (see :func:`shard_windows`)."""
        windows = shard_windows(self.num_train_windows(), seed=seed, round=round, rank=rank, world=world)
        offset = int(torch.randint(self.context_length, (1,), generator=generator(seed, round, 1)))
        return windows * self.context_length + offset

    def batches(self, starts: torch.Tensor, batch_size: int):
        """Yield (x, y) int64 batches over the given window starts, cycling if the shard runs out."""
        T = self.context_length
        i = 0
        while True:
            idx = starts[torch.arange(i, i + batch_size) % len(starts)]
            i += batch_size
            rows = self.train.rows(idx, T + 1)  # (B, T + 1)
            yield rows[:, :-1], rows[:, 1:]

    def val_batches(self, batch_size: int, max_batches: int):
        """Fixed, non-overlapping validation windows: the same on every peer and every call."""
        T = self.context_length
        # A window is T + 1 tokens: it may start at len - (T + 1), the last start of a split of T + 1 tokens.
        starts = torch.arange(0, len(self.val) - T, T)[: batch_size * max_batches]
        for i in range(0, len(starts), batch_size):
            rows = self.val.rows(starts[i : i + batch_size], T + 1)
            yield rows[:, :-1], rows[:, 1:]
