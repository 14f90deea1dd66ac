"""A hostile insider that trains like everyone else but sends something else than its pseudo-gradient.

    python -m bench.tamper ATTACK join --config ... [every other `p2ptrain join` argument]

It is a real `p2ptrain join` (it holds the swarm key, trains its shard, publishes honest records, applies
the swarm's average) whose averager sends ``ATTACKS[ATTACK](delta)`` for each tensor of its pseudo-gradient.
Every such part is finite, well shaped and sent with an honest weight, so each passes the reducers' checks
(``averaging.part_problem``): only robust aggregation or verification can do anything about it.
``bench/simulate.py --attack`` applies the same functions in a simulated swarm.
"""

from __future__ import annotations

import sys

import torch

_RANDOM = torch.Generator().manual_seed(0)  # a new direction at every call, the same run to run


def _noise(delta: torch.Tensor) -> torch.Tensor:
    return torch.randn(delta.shape, generator=_RANDOM) * 10 * float(delta.norm()) / delta.numel() ** 0.5


ATTACKS = {
    "sign_flip_x10": lambda d: -10 * d,
    "x10": lambda d: 10 * d,
    "noise": _noise,  # ten times the pseudo-gradient's norm, in a random direction
    "zero": torch.zeros_like,  # a free rider
}
"""What an insider can send instead of its pseudo-gradient ``d``, each of them finite and of the right shape."""


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ATTACKS:
        sys.exit(f"usage: python -m bench.tamper {{{','.join(ATTACKS)}}} join [p2ptrain join arguments]")
    attack = ATTACKS[sys.argv[1]]

    from p2ptrain import cli
    from p2ptrain.averaging import SwarmAverager

    honest_average = SwarmAverager.average

    def average(self, tensors, *, weight, round, attempts=None):
        return honest_average(
            self, [attack(t) for t in tensors], weight=weight, round=round, attempts=attempts
        )

    SwarmAverager.average = average  # type: ignore[method-assign]
    sys.argv = ["p2ptrain", *sys.argv[2:]]
    cli.main()


if __name__ == "__main__":
    main()
