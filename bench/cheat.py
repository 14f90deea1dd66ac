"""A hostile insider of a verifiable run: a real `p2ptrain join` whose work, or what it says about it, is not
what the round asked for.

    python -m bench.cheat ATTACK join --config ... [every other `p2ptrain join` argument]

It holds the swarm key, publishes signed records, seals, reveals and sketches like any replica; only the
part named by ATTACK is changed. Attacks on the work itself (the replicas catch these: its sketch is of
work that differs from its partner's):

  sign_flip_x10  commits to -10 times its pseudo-gradient
  x10            commits to 10 times its pseudo-gradient
  noise          commits to noise of 10 times its pseudo-gradient's norm
  zero           commits to zeros (a free rider)
  wrong_shard    trains other data than its shard (and claims its shard)
  lazy           trains a third of the inner steps and scales its pseudo-gradient up 3 times
  stale          commits to its previous round's pseudo-gradient
  poisoned       trains its shard with shuffled targets
  colluder       sign_flip_x10 computed alike by every colluder (run two: they agree with each other)
  drip           adds a bias of 1% of its pseudo-gradient's norm in a fixed direction

Attacks on what it says or sends (the work it commits to is honest):

  claim_weight   sends its replica group's whole weight (samples x 1, not x 1/replicas)
  copy_sketch    seals (and sends) -10 times its pseudo-gradient, and publishes its partner's sketch
  send_other     seals its pseudo-gradient and sends -10 times it (bench/tamper.py's sign flip)

Replicas cannot see these (the sketches they compare are honest); reducers do: each part they receive must
be the one its sender sealed, its sketch buckets those of that part, and its weight the verdict's.
"""

from __future__ import annotations

import sys
import time

import torch

_RANDOM = torch.Generator().manual_seed(0)


def _fixed_direction(shape: torch.Size, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(shape, generator=g)


def _noise(delta: torch.Tensor, index: int) -> torch.Tensor:
    return torch.randn(delta.shape, generator=_RANDOM) * 10 * float(delta.norm()) / delta.numel() ** 0.5


def _drip(delta: torch.Tensor, index: int) -> torch.Tensor:
    bias = _fixed_direction(delta.shape, index)
    return delta + 0.01 * float(delta.norm()) * bias / float(bias.norm())


DELTA_ATTACKS = {
    "sign_flip_x10": lambda d, i: -10 * d,
    "x10": lambda d, i: 10 * d,
    "noise": _noise,
    "zero": lambda d, i: torch.zeros_like(d),
    "colluder": lambda d, i: -10 * d,
    "drip": _drip,
}
"""Attacks that replace the pseudo-gradient ``d`` (tensor ``i``) before the seal."""
WORK_ATTACKS = ("wrong_shard", "lazy", "stale", "poisoned")
CLAIM_ATTACKS = ("claim_weight", "copy_sketch", "send_other")
ATTACKS = (*DELTA_ATTACKS, *WORK_ATTACKS, *CLAIM_ATTACKS)


def install(attack: str) -> None:
    """Patch this process's Trainer (and its parts) to carry out ``attack``."""
    from p2ptrain.averaging import SwarmAverager
    from p2ptrain.data import Corpus
    from p2ptrain.trainer import Trainer

    Trainer_ = Trainer
    honest_inner_phase = Trainer_.inner_phase

    def replace_delta(self, change) -> None:
        """Set the local params so that master - local is change(master - local)."""
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.diloco.model_params, self.diloco.master)):
                delta = m - p.detach().to("cpu", torch.float32)
                p.copy_((m - change(delta, i)).to(p.device, p.dtype))

    if attack in DELTA_ATTACKS:

        def inner_phase(self):
            stats = honest_inner_phase(self)
            replace_delta(self, DELTA_ATTACKS[attack])
            return stats

        Trainer_.inner_phase = inner_phase

    elif attack == "wrong_shard":
        honest_shard = Corpus.shard

        def shard(self, *, seed, round, rank, world):
            return honest_shard(self, seed=seed + 1, round=round, rank=rank, world=world)

        Corpus.shard = shard

    elif attack == "lazy":

        def inner_phase(self):
            full = self.cfg.inner.num_inner_steps
            self.cfg.inner.num_inner_steps = max(1, full // 3)
            try:
                stats = honest_inner_phase(self)
            finally:
                self.cfg.inner.num_inner_steps = full
            replace_delta(self, lambda d, i: 3 * d)
            stats.samples *= 3  # and says it did all of it
            return stats

        Trainer_.inner_phase = inner_phase

    elif attack == "stale":
        previous: dict[str, list[torch.Tensor]] = {}

        def inner_phase(self):
            stats = honest_inner_phase(self)
            current = self.diloco.pseudo_gradient()
            if "delta" in previous:
                old = previous["delta"]
                replace_delta(self, lambda d, i: old[i])
            previous["delta"] = current
            return stats

        Trainer_.inner_phase = inner_phase

    elif attack == "poisoned":
        honest_batches = Corpus.batches

        def batches(self, starts, batch_size):
            for x, y in honest_batches(self, starts, batch_size):
                yield x, y[torch.randperm(y.shape[0], generator=_RANDOM)]

        Corpus.batches = batches

    elif attack == "claim_weight":
        honest_verify = Trainer_.verify_round

        def verify_round(self, group, stats):
            out = honest_verify(self, group, stats)
            if stats.weight is not None:
                stats.weight *= len(self._replicas)
            return out

        Trainer_.verify_round = verify_round

    elif attack == "send_other":
        honest_average = SwarmAverager.average

        def average(self, tensors, *, weight, round, attempts=None):
            return honest_average(
                self, [-10 * t for t in tensors], weight=weight, round=round, attempts=attempts
            )

        SwarmAverager.average = average

    elif attack == "copy_sketch":

        def inner_phase(self):
            stats = honest_inner_phase(self)
            replace_delta(self, DELTA_ATTACKS["sign_flip_x10"])
            return stats

        def _sketch(self, seed):
            mates = [p for p in self._replicas if p != self.peer_id]
            got = self._await_claims(mates, "sketch", self.round, time.monotonic() + 30)
            copied = next((r.sketch for r in got.values() if r.sketch), None)
            if copied is None:
                return honest_sketch(self, seed)
            return torch.frombuffer(bytearray(copied), dtype=torch.float32)

        honest_sketch = Trainer_._sketch
        Trainer_.inner_phase = inner_phase
        Trainer_._sketch = _sketch
    else:
        raise ValueError(attack)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ATTACKS:
        sys.exit(f"usage: python -m bench.cheat {{{','.join(ATTACKS)}}} join [p2ptrain join arguments]")
    install(sys.argv[1])
    from p2ptrain import cli

    sys.argv = ["p2ptrain", *sys.argv[2:]]
    cli.main()


if __name__ == "__main__":
    main()
