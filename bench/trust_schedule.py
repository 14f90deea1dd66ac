"""Why verification's quality cost at k = 2 is structural in a short run: in-process DiLoCo (exact averaging,
the default experiment, verifiable rounds' fresh AdamW with the 5-step ramp) where each round trains a
given set of shards, one per replica group (replicas agree, so each group trains its shard once).

- ``honest``: 4 untrusted peers in 2 pairs until they are trusted (``--trusted-from``), then 4 shards.
- ``attack``: one of 4 attacks; its pair is void until it is banned (round 3), then the 3 honest peers train
  one shard as a group of three until they are trusted, then 3 shards.
- ``k1_shards_N``: N shards every round (rounds by steps, no verification), for scale.

    python -m bench.trust_schedule [--rounds 16] [--trusted-from 8]

Prints JSON: the final val loss of each schedule (not part of `make bench`: a development aid; its figures
are quoted in the verification issue's note).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from p2ptrain.aggregation import aggregator
from p2ptrain.config import load_config, parse_set
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.diloco import AverageResult, DiLoCo
from p2ptrain.evaluation import evaluate
from p2ptrain.inner import inner_lr, inner_step, make_optimizer, round_warmup
from p2ptrain.models import build_model

Schedule = Callable[[int], list[list[int]]]
"""round -> replica groups (peer indices); each group trains one shard."""


class _Average:
    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def average(self, tensors, *, weight, round, attempts=None):
        return AverageResult(tensors=[t.clone() for t in self.tensors], group_size=1)


def run(cfg, schedule: Schedule, peers: int = 4) -> float:
    corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    models = [build_model(cfg.model.name, cfg.model.context_length, seed=cfg.run.seed) for _ in range(peers)]
    outer = [
        DiLoCo(m, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov) for m in models
    ]
    aggregate = aggregator(cfg.averaging)
    steps = cfg.inner.num_inner_steps
    for r in range(cfg.outer.num_rounds):
        groups = schedule(r)
        deltas = []
        for index, group in enumerate(groups):
            i = group[0]  # its replicas agree: train the shard once
            optimizer = make_optimizer(outer[i].model_params, cfg.inner)
            starts = corpus.shard(seed=cfg.run.seed, round=r, rank=index, world=len(groups))
            batches = corpus.batches(starts, cfg.inner.batch_size)
            for s in range(steps):
                x, y = next(batches)
                lr = inner_lr(cfg.inner, r * steps + s) * round_warmup(s, cfg.verification.round_warmup_steps)
                inner_step(
                    models[i], outer[i].model_params, optimizer, x, y, lr=lr, grad_clip=cfg.inner.grad_clip
                )
            deltas.append(outer[i].pseudo_gradient())
        averaged = _Average([aggregate(ts, [1.0] * len(deltas)).tensor for ts in zip(*deltas)])
        for o in outer:
            o.sync(averaged, weight=1.0, round=r)
    return evaluate(models[0], corpus, cfg, torch.device("cpu"))["val_loss"]


def _shards(n: int) -> Schedule:
    return lambda r: [[i] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument(
        "--trusted-from", type=int, default=8, help="the round from which honest peers are trusted"
    )
    args = ap.parse_args()
    cfg = load_config(None, parse_set([f"outer.num_rounds={args.rounds}"]))
    t = args.trusted_from
    schedules: dict[str, Schedule] = {
        "honest": lambda r: [[0, 1], [2, 3]] if r < t else [[0], [1], [2], [3]],
        "attack": lambda r: [[0, 1]] if r < 3 else ([[0, 1, 2]] if r < max(t, 3) else [[0], [1], [2]]),
        **{f"k1_shards_{n}": _shards(n) for n in (4, 3, 2, 1)},
    }
    out: dict = {name: run(cfg, schedule) for name, schedule in schedules.items()}
    out["attack_over_honest"] = out["attack"] / out["honest"]
    out.update(rounds=args.rounds, trusted_from=t)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
