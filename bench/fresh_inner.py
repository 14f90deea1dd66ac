"""An honest peer whose inner optimizer starts afresh every round, as in a verifiable round, at k = 1 (the
learning rate ramped up over ``verification.round_warmup_steps`` too).

    python -m bench.fresh_inner join --config ... [every other `p2ptrain join` argument]

A verifiable round (verification.replicas > 1) starts a fresh AdamW and takes the learning rate as a
function of (round, step), so that replicas can agree. ``bench/verification.py`` runs a k = 1 swarm of these
peers to separate what that costs from what replicated shards cost.
"""

from __future__ import annotations

import sys


def install() -> None:
    from p2ptrain import inner, trainer
    from p2ptrain.trainer import Trainer

    honest_inner_phase, honest_lr = Trainer.inner_phase, inner.inner_lr
    warmup = {"steps": 0}

    def inner_phase(self):
        self.inner_opt = inner.make_optimizer(self.diloco.model_params, self.cfg.inner)
        self.inner_steps_total = self.round * self.cfg.inner.num_inner_steps  # the lr of (round, step)
        warmup["steps"] = self.cfg.verification.round_warmup_steps
        return honest_inner_phase(self)

    def inner_lr(cfg, step):  # the trainer's, with a verifiable round's ramp at the start of every round
        return honest_lr(cfg, step) * inner.round_warmup(step % cfg.num_inner_steps, warmup["steps"])

    Trainer.inner_phase = inner_phase
    trainer.inner_lr = inner_lr


def main() -> None:
    install()
    from p2ptrain import cli

    sys.argv = ["p2ptrain", *sys.argv[1:]]
    cli.main()


if __name__ == "__main__":
    main()
