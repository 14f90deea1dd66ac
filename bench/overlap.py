"""What overlapping the outer sync costs in quality: simulated peers in one process (no network), each round's
pseudo-gradient averaged while the next round's first τ inner steps train from the local params, then carried
over onto the new global params when the average lands (``outer.overlap``: ``DiLoCo.detach`` and ``land``,
the trainer's own code). τ is how many inner steps the sync takes; every run trains the same samples.

Side by side: τ = 0 (no overlap), the same τ steps carried over (all of them, and a share of them:
``outer.overlap_carry``, ``--carries``), and the same τ steps thrown away (the round then trains H - τ steps:
what a stale step would be worth if it were worth nothing). One seed's run
says little: the seed alone (data order, init) moves the final loss by 10% in this short run, and by a few
percent any change of schedule; each row is the mean over ``--seeds`` of each seed's ratio to its own run
without overlap.

    python -m bench.overlap [--taus 1 3] [--carries 1.0 0.75 0.5 0.25] [--peers 3] [--seeds 0 1 2] [--workers 2]
                            [--set outer.lr=0.5 ...] [--out bench/results/overlap.json] [--block overlap]
    python -m bench.overlap --tau-ranges 1-3 1-15 [--draws 2] [--peers 2] [--config configs/tiny.yaml] ...

``--tau-ranges``: instead of one τ for every peer and round, each peer's sync of each round takes a τ drawn
from a range, as timing has it in a real swarm; the steps are carried over at the experiment's
``outer.overlap_carry``, ``--draws`` runs per seed and range, and the table shows the worst run beside the
mean: a tail that the mean hides.

Each simulation runs on one thread; ``--workers`` of them at a time, in processes of their own. ``--set``
changes the default experiment (as ``p2ptrain join --set`` does), for every run alike, the runs without
overlap included: e.g. another outer learning rate, to see whether overlap's cost depends on it. It needs
``--out`` and ``--block`` of its own, and may not set what the bench sets per run (the seed, the overlap
and its share).

Writes bench/results/overlap.json and the overlap table in docs/benchmarks.md (``--out``, ``--block``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.report import DOC, RESULTS, replace_block
from bench.simulate import _Group
from p2ptrain.config import load_config, parse_set
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.diloco import DiLoCo
from p2ptrain.evaluation import evaluate
from p2ptrain.inner import inner_lr, inner_step, make_optimizer
from p2ptrain.models import build_model

ROOT = Path(__file__).resolve().parent.parent


def simulate(
    cfg, peers: int, tau: int | tuple[int, int], *, keep: bool = True, carry: float = 1.0, draw: int = 0
) -> float:
    """The final validation loss of ``peers`` simulated peers whose syncs each take ``tau`` inner steps,
    trained meanwhile from the local params and carried over (``keep``; the share ``carry`` of them) or thrown
    away when it lands. ``tau`` as (lo, hi): each peer's sync of each round takes a number of steps drawn
    uniformly from lo to hi (its own random numbers, seeded by the run's seed and ``draw``), as the machine's
    timing has it in a real swarm, where each peer's sync lands when its own averager is done."""
    corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    models = [build_model(cfg.model.name, cfg.model.context_length, seed=cfg.run.seed) for _ in range(peers)]
    outer = [
        DiLoCo(m, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov, carry=carry)
        for m in models
    ]
    inner = [make_optimizer(o.model_params, cfg.inner) for o in outer]
    H, rounds = cfg.inner.num_inner_steps, cfg.outer.num_rounds
    steps = [0] * peers
    batches: dict[tuple[int, int], object] = {}
    lo, hi = tau if isinstance(tau, tuple) else (tau, tau)
    draws = random.Random(f"{cfg.run.seed}:{draw}")
    stale = [0] * peers  # each peer's steps of the round trained before its last sync landed

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
        for i in range(peers):  # the round's steps left: its first ones ran while the last round was averaged
            train(i, r, H - stale[i])
        for o in outer:
            o.detach()
        group = _Group()
        deltas = [o.pseudo_gradient() for o in outer]
        group.pending = [(d, 1.0) for d in deltas]
        group.result = [sum(ts) / peers for ts in zip(*deltas)]
        for o in outer:
            o.sync(group, weight=1.0, round=r)
        if r < rounds - 1:
            stale = [draws.randint(lo, hi) for _ in range(peers)]
            for i in range(peers):
                train(i, r + 1, stale[i])
        for o in outer:
            if not keep:
                o.reset_model()  # detached: the steps taken since are dropped when it lands
            o.land()
    return evaluate(models[0], corpus, cfg, torch.device("cpu"))["val_loss"]


_OWN_KEYS = {"run.seed", "outer.overlap", "outer.overlap_carry"}
"""Set by the bench for each run (``--seeds``, ``--taus``, ``--carries``): ``--set`` may not change them."""


def _experiment(config: Path, sets: list[str]):
    return load_config(config, parse_set(sets))


Job = tuple[int, "int | tuple[int, int]", str, float, int]
"""(seed, τ or the range it is drawn from, "carried_over" | "thrown_away" | "none", carry, draw)."""


def _run(peers: int, config: Path, sets: list[str], job: Job) -> tuple[Job, float]:
    """One simulation in a worker process."""
    torch.set_num_threads(1)
    seed, tau, how, carry, draw = job
    default = _experiment(config, sets)
    cfg = default.model_copy(update={"run": default.run.model_copy(update={"seed": seed})})
    return job, simulate(cfg, peers, tau, keep=how != "thrown_away", carry=carry, draw=draw)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def spread(xs: list[float]) -> float:
    """The standard error of the mean of ``xs`` (one per seed)."""
    m = mean(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) ** 0.5 if len(xs) > 1 else 0.0


def _label(how: str, carry: float) -> str:
    return how if how != "carried_over" or carry == 1.0 else f"carried_over_{carry:g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--taus", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--carries", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.25])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], dest="sets", help="section.key=value, every run")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    ap.add_argument(
        "--tau-ranges",
        nargs="+",
        default=[],
        metavar="LO-HI",
        help="instead of --taus and --carries: each peer's sync of each round takes τ drawn from LO to HI, "
        "its steps carried over at the experiment's outer.overlap_carry; --draws runs per seed and range",
    )
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "overlap.json")
    ap.add_argument("--block", default="overlap", help="the table in docs/benchmarks.md to write")
    args = ap.parse_args()
    for item in args.sets:  # what the bench sets itself per run would silently win over these
        if item.partition("=")[0].strip() in _OWN_KEYS:
            ap.error(f"--set {item}: the bench sets it per run (--seeds, --taus, --carries)")
    own = args.sets or args.tau_ranges or args.peers != 3 or args.config.name != "default.yaml"
    if own and (args.out == RESULTS / "overlap.json" or args.block == "overlap"):
        ap.error(
            "--set, --config, --peers and --tau-ranges need an --out and a --block of their own (the "
            "default experiment's table stays as it is)"
        )
    if f"<!-- {args.block}:start -->" not in DOC.read_text():  # before the runs, not after them
        ap.error(f"--block {args.block}: {DOC} has no <!-- {args.block}:start --> marker")
    ranges = []
    for item in args.tau_ranges:
        lo, _, hi = item.partition("-")
        if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            ap.error(f"--tau-ranges {item}: expected LO-HI, whole numbers with 1 <= LO <= HI")
        ranges.append((int(lo), int(hi)))
    default = _experiment(args.config, args.sets)
    t0 = time.monotonic()
    jobs: list[Job] = [(seed, 0, "none", 1.0, 0) for seed in args.seeds]
    for seed in args.seeds:
        if ranges:
            share = default.outer.overlap_carry
            jobs += [(seed, r, "carried_over", share, d) for r in ranges for d in range(args.draws)]
            continue
        for tau in args.taus:
            jobs += [(seed, tau, "carried_over", c, 0) for c in args.carries]
            jobs.append((seed, tau, "thrown_away", 1.0, 0))
    done: dict[Job, float] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for job, loss in pool.map(partial(_run, args.peers, args.config, args.sets), jobs):
            done[job] = loss
            print(
                f"seed {job[0]}, tau {job[1]}, {_label(job[2], job[3])}, draw {job[4]}: {loss:.4f}",
                flush=True,
            )
    if ranges:
        _drawn(args, default, ranges, done, t0)
        return
    columns = [("carried_over", c) for c in args.carries] + [("thrown_away", 1.0)]
    by_seed: dict[int, dict[str, Any]] = {
        seed: {
            "no_overlap": done[(seed, 0, "none", 1.0, 0)],
            "runs": [
                {"tau": tau} | {_label(how, c): done[(seed, tau, how, c, 0)] for how, c in columns}
                for tau in args.taus
            ],
        }
        for seed in args.seeds
    }
    rows_by_tau = []
    for i, tau in enumerate(args.taus):
        row: dict = {"tau": tau}
        for how, c in columns:
            label = _label(how, c)
            ratios = [s["runs"][i][label] / s["no_overlap"] for s in by_seed.values()]
            row[f"{label}_ratio"] = mean(ratios)
            row[f"{label}_ratio_stderr"] = spread(ratios)
        shares = [c for c in args.carries if c != 1.0]
        # Seed by seed, the default share against keeping all: the pairs are what tell them apart.
        if shares and 1.0 in args.carries:
            share = default.outer.overlap_carry if default.outer.overlap_carry in shares else shares[0]
            half = _label("carried_over", share)
            row["paired"] = {
                "against": "carried_over",
                "share": half,
                "better_in_seeds": sum(
                    s["runs"][i][half] < s["runs"][i]["carried_over"] for s in by_seed.values()
                ),
                "ratio": mean([s["runs"][i][half] / s["runs"][i]["carried_over"] for s in by_seed.values()]),
            }
        rows_by_tau.append(row)
    _write(args, default, by_seed, rows_by_tau, t0, table, carries=args.carries)


def _drawn(args, default, ranges: list[tuple[int, int]], done: dict[Job, float], t0: float) -> None:
    """Write the results of staleness drawn per peer and round (``--tau-ranges``) and their table."""
    share = default.outer.overlap_carry
    by_seed: dict[int, dict[str, Any]] = {
        seed: {
            "no_overlap": done[(seed, 0, "none", 1.0, 0)],
            "runs": [
                {
                    "tau_range": list(r),
                    "val_loss": [done[(seed, r, "carried_over", share, d)] for d in range(args.draws)],
                }
                for r in ranges
            ],
        }
        for seed in args.seeds
    }
    rows = []
    for i, r in enumerate(ranges):
        ratios = {
            seed: [x / s["no_overlap"] for x in s["runs"][i]["val_loss"]] for seed, s in by_seed.items()
        }
        # The seed is the unit: a seed's draws share its init and data, and are not independent of each other.
        per_seed = [mean(rs) for rs in ratios.values()]
        rows.append(
            {
                "tau_range": list(r),
                "ratio": mean(per_seed),
                "ratio_stderr": spread(per_seed),
                "worst_ratio": max(x for rs in ratios.values() for x in rs),
            }
        )
    _write(args, default, by_seed, rows, t0, drawn_table, overlap_carry=share, draws=args.draws)


def _write(args, default, by_seed: dict, mean_ratios: list[dict], t0: float, table_of, **setup) -> None:
    """Write the results (``--out``) and their table (``table_of``, into ``--block``)."""
    out = {
        "experiment": {
            "config": args.config.name,
            "model": default.model.name,
            "peers": args.peers,
            "rounds": default.outer.num_rounds,
            "inner_steps": default.inner.num_inner_steps,
            "outer": {
                "lr": default.outer.lr,
                "momentum": default.outer.momentum,
                "nesterov": default.outer.nesterov,
            },
            "seeds": args.seeds,
            **setup,
            "overrides": args.sets,
        },
        "by_seed": by_seed,
        "mean_ratios": mean_ratios,
        "seconds": round(time.monotonic() - t0),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    lines = table_of(out)
    replace_block(args.block, lines)
    print("\n".join(lines))


def drawn_table(out: dict) -> list[str]:
    """The table of :func:`_drawn`'s results (``--tau-ranges``)."""
    e, by_seed = out["experiment"], out["by_seed"]
    seeds = ", ".join(str(s) for s in by_seed)
    bases = ", ".join(f"{s['no_overlap']:.3f}" for s in by_seed.values())
    rows = [
        f"| each peer's sync takes τ inner steps (of H = {e['inner_steps']}), drawn each round from | val loss by "
        f"seed ({seeds}; its {e['draws']} draws apart by /) | mean vs no overlap (± s.e. over seeds) | worst run "
        "vs its seed's without overlap |",
        "| --- | --- | --- | --- |",
        f"| 0 (no overlap) | {bases} | 1.000 | — |",
    ]
    for i, r in enumerate(out["mean_ratios"]):
        losses = ", ".join("/".join(f"{x:.3f}" for x in s["runs"][i]["val_loss"]) for s in by_seed.values())
        lo, hi = r["tau_range"]
        rows.append(
            f"| {lo} to {hi} | {losses} | {r['ratio']:.3f} ± {r['ratio_stderr']:.3f} | {r['worst_ratio']:.3f} |"
        )
    sets = "".join(f", `{s}`" for s in e["overrides"])
    rows += [
        "",
        f"{e['peers']} simulated peers, `configs/{e['config']}`{sets}: {e['model']}, {e['rounds']} rounds, outer "
        f"lr {e['outer']['lr']:g}, momentum {e['outer']['momentum']:g}; the steps trained before a sync lands "
        f"carried over at {e['overlap_carry']:g} (`outer.overlap_carry`).",
    ]
    return rows


def table(out: dict) -> list[str]:
    """An overlap table of docs/benchmarks.md from the contents of what :func:`main` wrote (``--out``)."""
    by_seed = out["by_seed"]
    H, carries = out["experiment"]["inner_steps"], out["experiment"]["carries"]
    columns = [("carried_over", c) for c in carries] + [("thrown_away", 1.0)]
    seeds = ", ".join(str(s) for s in by_seed)
    bases = [s["no_overlap"] for s in by_seed.values()]
    head = [f"sync takes τ inner steps (of H = {H})"]
    for how, c in columns:
        name = {
            "carried_over": f"steps carried over, share {c:g} (`outer.overlap_carry`)",
            "thrown_away": "steps thrown away",
        }[how]
        head += [f"val loss by seed ({seeds}), {name}", "mean vs no overlap (± s.e.)"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    rows.append(
        f"| 0 (no overlap) | {', '.join(f'{b:.3f}' for b in bases)} | 1.000 |"
        + " — | — |" * (len(columns) - 1)
    )
    for i, r in enumerate(out["mean_ratios"]):
        cells = [str(r["tau"])]
        for how, c in columns:
            label = _label(how, c)
            cells.append(", ".join(f"{s['runs'][i][label]:.3f}" for s in by_seed.values()))
            cells.append(f"{r[f'{label}_ratio']:.3f} ± {r[f'{label}_ratio_stderr']:.3f}")
        rows.append("| " + " | ".join(cells) + " |")
    paired = [
        f"{r['paired']['better_in_seeds']} of {len(by_seed)} seeds at τ = {r['tau']} (mean ratio "
        f"{r['paired']['ratio']:.3f})"
        for r in out["mean_ratios"]
        if "paired" in r
    ]
    if out["experiment"].get("overrides"):
        sets = ", ".join(f"`{s}`" for s in out["experiment"]["overrides"])
        rows += ["", f"Every run of this table, those without overlap included, with {sets}."]
    if paired:
        share = out["mean_ratios"][0]["paired"]["share"].removeprefix("carried_over_")
        rows += [
            "",
            f"Seed by seed, keeping a share of {share} ends lower than keeping all in "
            + ", and ".join(paired)
            + ".",
        ]
    return rows


if __name__ == "__main__":
    main()
