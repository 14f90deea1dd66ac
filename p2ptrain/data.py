"""Byte-level text corpora and each peer's shard of them.

The corpus is split once, deterministically: the last ``val_fraction`` of its bytes is validation.
Training windows start at multiples of the context length (plus a per-round offset, so that the
model sees every alignment over time). Each round, every peer computes the same seeded permutation
of those windows and takes the slice of its rank in the round's roster of peers: no two peers of
a round train on the same window, and nobody has to send anybody an index.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


class DataSource(Protocol):
    """Where the corpus comes from (``config.DataConfig``; config.py hashes corpora with this module)."""

    @property
    def source(self) -> str: ...
    @property
    def path(self) -> Path | None: ...


def load_corpus(cfg: DataSource) -> bytes:
    """The corpus as bytes: Python's own documentation topics, or the user's text file."""
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
    assert cfg.path is not None  # enforced by DataConfig
    path = Path(cfg.path).resolve()
    stat = path.stat()
    return _file_digest(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _pydoc_digest() -> str:
    return hashlib.sha256(_pydoc_bytes()).hexdigest()


@functools.lru_cache(maxsize=16)  # keyed on size and mtime as well: a rewritten file is read again
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Corpus:
    train: torch.Tensor  # uint8, (N_train,)
    val: torch.Tensor  # uint8, (N_val,)
    context_length: int

    @classmethod
    def from_bytes(cls, data: bytes, context_length: int, val_fraction: float) -> Corpus:
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n_val = max(int(len(tokens) * val_fraction), context_length + 1)
        if len(tokens) - n_val < 2 * (context_length + 1):
            raise ValueError(
                f"the corpus has {len(tokens)} bytes: too small for model.context_length {context_length}"
            )
        return cls(train=tokens[:-n_val], val=tokens[-n_val:], context_length=context_length)

    def num_train_windows(self) -> int:
        # Windows are context_length + 1 bytes (inputs and the next-byte targets); the offset can add up to
        # context_length - 1, hence the -1 window.
        return (len(self.train) - 1) // self.context_length - 1

    def shard(self, *, seed: int, round: int, rank: int, world: int) -> torch.Tensor:
        """Window start offsets of this peer's shard for one round (see :func:`shard_windows`)."""
        windows = shard_windows(self.num_train_windows(), seed=seed, round=round, rank=rank, world=world)
        offset = int(torch.randint(self.context_length, (1,), generator=_generator(seed, round, 1)))
        return windows * self.context_length + offset

    def batches(self, starts: torch.Tensor, batch_size: int):
        """Yield (x, y) int64 batches over the given window starts, cycling if the shard runs out."""
        T = self.context_length
        offsets = torch.arange(T + 1)
        i = 0
        while True:
            idx = starts[torch.arange(i, i + batch_size) % len(starts)]
            i += batch_size
            rows = self.train[idx[:, None] + offsets].long()  # (B, T + 1): one gather, no Python loop
            yield rows[:, :-1], rows[:, 1:]

    def val_batches(self, batch_size: int, max_batches: int):
        """Fixed, non-overlapping validation windows: the same on every peer and every call."""
        T = self.context_length
        starts = torch.arange(0, len(self.val) - T - 1, T)[: batch_size * max_batches]
        offsets = torch.arange(T + 1)
        for i in range(0, len(starts), batch_size):
            rows = self.val[starts[i : i + batch_size, None] + offsets].long()
            yield rows[:, :-1], rows[:, 1:]


def _generator(seed: int, round: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + round) * 7 + stream)


def shard_windows(num_windows: int, *, seed: int, round: int, rank: int, world: int) -> torch.Tensor:
    """Indices of the windows that peer ``rank`` of ``world`` trains on in ``round``.

    Every peer computes the same permutation from (seed, round) and takes its contiguous slice, so the
    slices of one round are disjoint and together cover all windows. Deterministic: same arguments,
    same shard.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    if num_windows < world:
        raise ValueError(f"{num_windows} windows cannot be shared among {world} peers")
    order = torch.randperm(num_windows, generator=_generator(seed, round, 0))
    bounds = [num_windows * r // world for r in range(world + 1)]
    return order[bounds[rank] : bounds[rank + 1]]
