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

    def average(self, tensors, *, weight, round, attempts=None):
        assert self.result is not None
        return AverageResult(tensors=[t.clone() for t in self.result], group_size=len(self.pending))


def simulate(
    cfg,
    peers: int,
    attack: str | None = None,
    *,
    fresh_inner: bool = False,
    replicas: int = 1,
    round_warmup: int = 0,
) -> dict:
    """``fresh_inner``: a fresh AdamW every round, the lr a function of (round, step), as in a verifiable
    round; ``replicas``: peers in groups of that many train the same shard (each group counts once);
    ``round_warmup``: the lr ramps up over each round's first steps (with ``fresh_inner``)."""
    corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    models = [build_model(cfg.model.name, cfg.model.context_length, seed=cfg.run.seed) for _ in range(peers)]
    outer = [
        DiLoCo(m, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov) for m in models
    ]
    inner = [make_optimizer(o.model_params, cfg.inner) for o in outer]
    aggregate = aggregator(cfg.averaging)
    steps = 0
    curve = []
    shards = max(1, peers // replicas)
    for r in range(cfg.outer.num_rounds):
        for i in range(peers):
            if fresh_inner:
                inner[i] = make_optimizer(outer[i].model_params, cfg.inner)
            batches = corpus.batches(
                corpus.shard(seed=cfg.run.seed, round=r, rank=i % shards, world=shards), cfg.inner.batch_size
            )
            for s in range(cfg.inner.num_inner_steps):
                x, y = next(batches)
                lr = inner_lr(cfg.inner, steps + s)
                if round_warmup:
                    lr *= min(1.0, (s + 1) / round_warmup)
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
    ap.add_argument(
        "--fresh-inner", action="store_true", help="a fresh AdamW every round (verifiable rounds)"
    )
    ap.add_argument("--replicas", type=int, default=1, help="peers per shard (each shard counts once)")
    ap.add_argument("--round-warmup", type=int, default=0, help="lr warmup steps at the start of every round")
    args = ap.parse_args()
    cfg = load_config(args.config, parse_set(args.sets))
    t0 = time.monotonic()
    result = simulate(
        cfg,
        args.peers,
        args.attack,
        fresh_inner=args.fresh_inner,
        replicas=args.replicas,
        round_warmup=args.round_warmup,
    )
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["sets"] = args.sets
    result.update(fresh_inner=args.fresh_inner, replicas=args.replicas, round_warmup=args.round_warmup)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
