"""How a reducer combines its groupmates' parts of the pseudo-gradient: robustly, by default.

A plain weighted mean lets one groupmate move the average anywhere: a peer that sends ten times its
pseudo-gradient with the sign flipped (finite, well shaped, a plausible weight: every check of
``averaging.part_problem`` passes) makes a simulated four-peer DiLoCo diverge. CenteredClip (Karimireddy,
He and Jaggi, "Learning from History for Byzantine Robust Optimization", 2021; the aggregator of BTARD)
bounds what any one part can do: it looks for the point ``v`` where

    sum_i w_i * clip(x_i - v, tau) = 0,        clip(d, tau) = d * min(1, tau / ||d||),

so a part far from the others pulls ``v`` by at most ``tau`` times its share of the weight. When no part is
farther than ``tau`` from the result, that point is exactly the weighted mean: with ``tau`` well above the
honest spread, robustness costs honest groups nothing.

``tau`` is not a fixed constant (the scale of pseudo-gradients changes over a run by orders of magnitude):
it is ``clip_radius`` times the median distance of the parts from their coordinate-wise median, measured
afresh for every part. A minority of attackers cannot raise it, since the median distance is an honest
peer's (colluders that copy one honest part can lower it, which leaves the other honest parts out: the
result is still honest, averaged over fewer peers). A part farther than ``reject_radius`` spreads gets no
weight at all: clipped, a scaled or sign-flipped pseudo-gradient would still pull every round's result by
``tau`` times its share, the same way each round. Nothing here helps a group of two: with no majority
there is nothing to tell which one is right (the median of two is their mean, and so is the result).

Pure functions of tensors: the reducer (``averaging.py``), the in-memory swarm of the tests and the
benchmarks all call these.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from p2ptrain.config import AveragingConfig


@dataclass(frozen=True)
class Aggregated:
    tensor: torch.Tensor
    """The aggregate: float32, finite, of the parts' shape."""
    left_out: tuple[int, ...] = ()
    """Indices of the parts that got no weight (farther than ``reject_radius`` spreads from the median)."""


Aggregate = Callable[[Sequence[torch.Tensor], Sequence[float]], Aggregated]
"""Combine parts of one shape, with their weights, into one part of that shape."""

MAX_ITERS = 50
"""CenteredClip's fixed-point iterations at most; it usually settles in a few."""


_FLOAT32_MAX = torch.finfo(torch.float32).max

# Both aggregates are computed in float64 and returned in float32, always finite. A groupmate may send
# finite float32 values near the format's limit: summed or squared in float32 they overflow, and a reducer
# whose answer is not finite is blamed for it by everyone in the group (averaging.part_problem).


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    total = float(sum(weights))
    out = torch.zeros_like(parts[0], dtype=torch.float64)
    for part, weight in zip(parts, weights):
        out.add_(part.double(), alpha=weight)
    return out.div_(total).clamp_(-_FLOAT32_MAX, _FLOAT32_MAX).float()


def mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> Aggregated:
    """The weighted mean as an :data:`Aggregate`: it leaves nothing out."""
    return Aggregated(weighted_mean(parts, weights))


SORTING_NETWORK_MAX = 16
"""Up to this many parts, :func:`coordinate_median` sorts each coordinate with elementwise min / max (an
odd-even transposition network): torch's sort along a short first dimension is slow (3.3 ms for 3 parts of
128 Ki values on this machine, against 0.45 ms; 14 ms against 4.6 for 8 parts; 38 against 24 for 16)."""


def coordinate_median(parts: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The median of each coordinate (the mean of the two middle values for an even count), in float64.
    ``parts``: tensors of one shape, or one tensor stacking them along its first dimension."""
    rows = [p.double() for p in parts]
    n = len(rows)
    if n > SORTING_NETWORK_MAX:
        ordered = torch.stack(rows).sort(dim=0).values
        return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    for r in range(n):  # n rounds of odd-even transposition sort every column
        for i in range(r % 2, n - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return (rows[(n - 1) // 2] + rows[n // 2]) / 2


def centered_clip(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    clip_radius: float = 2.0,
    reject_radius: float = math.inf,
) -> Aggregated:
    """The CenteredClip aggregate of ``parts`` (same shape, finite) with positive ``weights``.

    Starts at the coordinate-wise median; parts farther from it than ``reject_radius`` times the median
    distance of the parts from it are left out, and the rest are clipped at ``clip_radius`` times that
    distance. Deterministic: the same inputs give the same bits.
    """
    if not parts:
        raise ValueError("nothing to aggregate")
    if len(parts) != len(weights):
        raise ValueError(f"{len(parts)} parts but {len(weights)} weights")
    xs = torch.stack([p.double().reshape(-1) for p in parts])
    v = coordinate_median(xs)
    distances = torch.linalg.vector_norm(xs - v, dim=1)
    spread = float(coordinate_median(distances))  # each distance a "part" of one value
    tau = clip_radius * spread
    if tau == 0.0:  # most parts are equal: that value is the answer
        return Aggregated(v.float().reshape(parts[0].shape), _indices(distances > 0))
    # A part far beyond the others' spread is no pseudo-gradient of this round: it gets no weight at all
    # (clipped, it would still pull the result by tau times its share, round after round).
    kept = distances <= reject_radius * spread  # at least half the parts: the median distance is <= itself
    xs = xs[kept]
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)[kept]
    share = w / w.sum()
    # When no kept part is farther than tau from their weighted mean, the mean is the fixed point: unclipped,
    # the offsets sum to zero there. The problem is convex (a Huber loss of each distance) and strictly so
    # around that point, so it is the only one: the answer, exactly, for the price of one pass (an honest
    # group's usual case; the iterations below took 5 ms a part to approach it).
    m = share @ xs
    if bool((torch.linalg.vector_norm(xs - m, dim=1) <= tau).all()):
        return Aggregated(
            m.clamp_(-_FLOAT32_MAX, _FLOAT32_MAX).float().reshape(parts[0].shape), _indices(~kept)
        )
    for _ in range(MAX_ITERS):
        offsets = xs - v
        norms = torch.linalg.vector_norm(offsets, dim=1)
        scale = torch.clamp(tau / torch.clamp(norms, min=1e-30), max=1.0)
        step = (share * scale) @ offsets
        v = v + step
        if float(torch.linalg.vector_norm(step)) <= 1e-6 * tau:
            break
    return Aggregated(v.float().reshape(parts[0].shape), _indices(~kept))


def _indices(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero().flatten())


def aggregator(cfg: AveragingConfig) -> Aggregate:
    """The aggregate function of ``averaging.aggregator``, with its radii."""
    if cfg.aggregator == "mean":
        return mean
    return lambda parts, weights: centered_clip(
        parts, weights, clip_radius=cfg.clip_radius, reject_radius=cfg.reject_radius
    )
