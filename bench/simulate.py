"""DiLoCo without the network, for tuning: N simulated peers in one process, exact averaging.

Uses p2ptrain's own DiLoCo class, model, data shards, inner optimizer and aggregator
(``averaging.aggregator``), with a perfect in-memory averager in one group. What it measures is the
algorithm's quality under a config, not the swarm's speed. ``--attack`` makes the last peer send
something else than its pseudo-gradient (``bench/tamper.py``); it still applies the group's result.

    python -m bench.simulate --peers 3 --set inner.num_inner_steps=10 --set outer.num_rounds=24
    python -m bench.simulate --peers 4 --attack sign_flip_x10 --set averaging.aggregator=mean
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.tamper import ATTACKS
from p2ptrain.aggregation import aggregator
from p2ptrain.config import load_config, parse_set
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.diloco import AverageResult, DiLoCo
from p2ptrain.evaluation import evaluate
from p2ptrain.inner import inner_lr, inner_step, make_optimizer
from p2ptrain.models import build_model


class _Group:
    """Collects every simulated peer's pseudo-gradient, then hands out the weighted average."""

    def __init__(self) -> None:
        self.pending: list[tuple[list[torch.Tensor], float]] = []
        self.result: list[torch.Tensor] | None = None

    def average(self, tensors, *, weight, round):
        assert self.result is not None
        return AverageResult(tensors=[t.clone() for t in self.result], group_size=len(self.pending))


def simulate(cfg, peers: int, attack: str | None = None) -> dict:
    corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    models = [build_model(cfg.model.name, cfg.model.context_length, seed=cfg.run.seed) for _ in range(peers)]
    outer = [
        DiLoCo(m, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov) for m in models
    ]
    inner = [make_optimizer(o.model_params, cfg.inner) for o in outer]
    aggregate = aggregator(cfg.averaging)
    steps = 0
    curve = []
    for r in range(cfg.outer.num_rounds):
        for i in range(peers):
            batches = corpus.batches(
                corpus.shard(seed=cfg.run.seed, round=r, rank=i, world=peers), cfg.inner.batch_size
            )
            for s in range(cfg.inner.num_inner_steps):
                x, y = next(batches)
                lr = inner_lr(cfg.inner, steps + s)
                inner_step(
                    models[i], outer[i].model_params, inner[i], x, y, lr=lr, grad_clip=cfg.inner.grad_clip
                )
        steps += cfg.inner.num_inner_steps
        deltas = [o.pseudo_gradient() for o in outer]
        if attack is not None:
            deltas[-1] = [ATTACKS[attack](t) for t in deltas[-1]]
        group = _Group()
        group.pending = [(d, 1.0) for d in deltas]
        # Tensor by tensor, as hivemind's reducers do when every tensor fits in one part (under int8 a part
        # holds up to 516,096 values; the largest tensor of gpt-micro has 65,536).
        group.result = [aggregate(ts, [1.0] * peers).tensor for ts in zip(*deltas)]
        for o in outer:
            o.sync(group, weight=1.0, round=r)
        curve.append(evaluate(models[0], corpus, cfg, torch.device("cpu"))["val_loss"])
    return {"val_loss": curve[-1], "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--attack", choices=sorted(ATTACKS), default=None)
    args = ap.parse_args()
    cfg = load_config(args.config, parse_set(args.sets))
    t0 = time.monotonic()
    result = simulate(cfg, args.peers, args.attack)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["sets"] = args.sets
    print(json.dumps(result))


if __name__ == "__main__":
    main()
