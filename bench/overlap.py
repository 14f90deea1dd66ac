"""What overlapping the outer sync costs in quality: simulated peers in one process (no network), each round's
pseudo-gradient averaged while the next round's first τ inner steps train from the local params, then carried
over onto the new global params when the average lands (``outer.overlap``: ``DiLoCo.detach`` and ``land``,
the trainer's own code). τ is how many inner steps the sync takes; every run trains the same samples.

Side by side: τ = 0 (no overlap), the same τ steps carried over, and the same τ steps thrown away (the
round then trains H - τ steps: what a stale step would be worth if it were worth nothing). One seed's run
says little: the seed alone (data order, init) moves the final loss by 10% in this short run, and by a few
percent any change of schedule; each row is the mean over ``--seeds`` of each seed's ratio to its own run
without overlap.

    python -m bench.overlap [--taus 1 3] [--peers 3] [--seeds 0 1 2]

Writes bench/results/overlap.json and the overlap table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.report import RESULTS, replace_block
from bench.simulate import _Group
from p2ptrain.config import load_config
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.diloco import DiLoCo
from p2ptrain.evaluation import evaluate
from p2ptrain.inner import inner_lr, inner_step, make_optimizer
from p2ptrain.models import build_model

ROOT = Path(__file__).resolve().parent.parent


def simulate(cfg, peers: int, tau: int, *, keep: bool = True) -> float:
    """The final validation loss of ``peers`` simulated peers whose syncs each take ``tau`` inner steps,
    trained meanwhile from the local params and carried over (``keep``) or thrown away when it lands."""
    corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    models = [build_model(cfg.model.name, cfg.model.context_length, seed=cfg.run.seed) for _ in range(peers)]
    outer = [
        DiLoCo(m, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov) for m in models
    ]
    inner = [make_optimizer(o.model_params, cfg.inner) for o in outer]
    H, rounds = cfg.inner.num_inner_steps, cfg.outer.num_rounds
    steps = [0] * peers
    batches: dict[tuple[int, int], object] = {}

    def train(i: int, r: int, n: int) -> None:
        if (i, r) not in batches:
            shard = corpus.shard(seed=cfg.run.seed, round=r, rank=i, world=peers)
            batches[(i, r)] = corpus.batches(shard, cfg.inner.batch_size)
        for _ in range(n):
            x, y = next(batches[(i, r)])  # type: ignore[call-overload]
            lr = inner_lr(cfg.inner, steps[i])
            inner_step(models[i], outer[i].model_params, inner[i], x, y, lr=lr, grad_clip=cfg.inner.grad_clip)
            steps[i] += 1

    for r in range(rounds):
        for i in range(peers):  # the round's steps left: its first τ ran while the last round was averaged
            train(i, r, H if r == 0 or tau == 0 else H - tau)
        for o in outer:
            o.detach()
        group = _Group()
        deltas = [o.pseudo_gradient() for o in outer]
        group.pending = [(d, 1.0) for d in deltas]
        group.result = [sum(ts) / peers for ts in zip(*deltas)]
        for o in outer:
            o.sync(group, weight=1.0, round=r)
        if tau and r < rounds - 1:
            for i in range(peers):
                train(i, r + 1, tau)
        for o in outer:
            if not keep:
                o.reset_model()  # detached: the steps taken since are dropped when it lands
            o.land()
    return evaluate(models[0], corpus, cfg, torch.device("cpu"))["val_loss"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--taus", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    default = load_config(ROOT / "configs" / "default.yaml")
    t0 = time.monotonic()
    by_seed = {}
    for seed in args.seeds:
        cfg = default.model_copy(update={"run": default.run.model_copy(update={"seed": seed})})
        base = simulate(cfg, args.peers, 0)
        print(f"seed {seed}: no overlap {base:.4f}", flush=True)
        runs = []
        for tau in args.taus:
            kept, dropped = simulate(cfg, args.peers, tau), simulate(cfg, args.peers, tau, keep=False)
            runs.append({"tau": tau, "carried_over": kept, "thrown_away": dropped})
            print(f"seed {seed}, tau {tau}: carried over {kept:.4f}, thrown away {dropped:.4f}", flush=True)
        by_seed[seed] = {"no_overlap": base, "runs": runs}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rows_by_tau = []
    for i, tau in enumerate(args.taus):
        rows_by_tau.append(
            {
                "tau": tau,
                "carried_over_ratio": mean(
                    [s["runs"][i]["carried_over"] / s["no_overlap"] for s in by_seed.values()]
                ),
                "thrown_away_ratio": mean(
                    [s["runs"][i]["thrown_away"] / s["no_overlap"] for s in by_seed.values()]
                ),
            }
        )
    H = default.inner.num_inner_steps
    cfg = default
    out = {
        "experiment": {
            "model": cfg.model.name,
            "peers": args.peers,
            "rounds": cfg.outer.num_rounds,
            "inner_steps": H,
            "outer": {"lr": cfg.outer.lr, "momentum": cfg.outer.momentum, "nesterov": cfg.outer.nesterov},
            "seeds": args.seeds,
        },
        "by_seed": by_seed,
        "mean_ratios": rows_by_tau,
        "seconds": round(time.monotonic() - t0),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "overlap.json").write_text(json.dumps(out, indent=2) + "\n")
    seeds = ", ".join(str(s) for s in args.seeds)
    bases = [s["no_overlap"] for s in by_seed.values()]
    rows = [
        f"| sync takes τ inner steps (of H = {H}) | val loss by seed ({seeds}), steps carried over "
        "(`outer.overlap`) | mean vs no overlap | val loss by seed, steps thrown away | mean vs no overlap |",
        "| --- | --- | --- | --- | --- |",
        f"| 0 (no overlap) | {', '.join(f'{b:.3f}' for b in bases)} | 1.000 | — | 1.000 |",
    ]
    for i, r in enumerate(rows_by_tau):
        kept = ", ".join(f"{s['runs'][i]['carried_over']:.3f}" for s in by_seed.values())
        dropped = ", ".join(f"{s['runs'][i]['thrown_away']:.3f}" for s in by_seed.values())
        rows.append(
            f"| {r['tau']} | {kept} | {r['carried_over_ratio']:.3f} | {dropped} | {r['thrown_away_ratio']:.3f} |"
        )
    replace_block("overlap", rows)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
