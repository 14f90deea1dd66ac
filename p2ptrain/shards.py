"""Who trains on what in a round: every peer computes the same seeded permutation of the data's units (a
corpus's windows, an image set's images) and takes the slice of its rank in the round's roster, so that the
slices of a round are disjoint and cover everything, and no index ever travels.
"""

from __future__ import annotations

import torch


def generator(seed: int, round: int, stream: int) -> torch.Generator:
    # Modulo 2**64, what a torch seed holds (the same seed as before for any seed below about 2**40).
    return torch.Generator().manual_seed(((seed * 1_000_003 + round) * 7 + stream) % (1 << 64))


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
    order = torch.randperm(num_windows, generator=generator(seed, round, 0))
    bounds = [num_windows * r // world for r in range(world + 1)]
    return order[bounds[rank] : bounds[rank + 1]]
