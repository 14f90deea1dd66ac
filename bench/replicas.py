"""Replica verification benchmark, over recorded pseudo-gradients: does a verdict catch every attack, and
never an honest replica?

Trains the default experiment's model along a swarm's trajectory (one group of ``--shards`` shards, the
outer step taken with the honest average) and, at every round, recomputes shard 0 from the round's params
as a verifiable round does (a fresh AdamW, the lr a function of (round, step), the same data):

* honest replicas: float32 on 1 thread, float32 on 2 threads, bfloat16 autocast;
* attackers: another shard, lazy (a third of the steps, scaled ×3), poisoned data (the shard's bytes
  shuffled), stale (last round's pseudo-gradient), zero, sign flip, ×10, noise of the same norm, two
  colluders with the same wrong pseudo-gradient, and a slow drip (the honest pseudo-gradient plus a fixed
  bias of 1%, 5% and 20% of its norm).

Each comparison takes both pseudo-gradients as they would go on the wire (``verify.wire``, the default
config's codec), commits to their parts, seeds a sketch from the commitments (``verify.sketch_seed``) and
asks ``verify.judge`` about the pair (an honest replica of each class against the attacker), with
``--seeds`` independent sketches per attacker pair and ``--honest-seeds`` per honest pair (what other
groups' commitments would give). Reported per attack: comparisons, detections, the distances seen; and for
honest pairs the false positives.

    python -m bench.replicas [--rounds 30] [--seeds 4] [--honest-seeds 40] [--grace 5]

Writes the ``replicas`` part of bench/results/verification.json and the replicas table of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.report import DOC, merge_results, replace_block
from p2ptrain.compression import codec_for
from p2ptrain.config import load_config
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.diloco import DiLoCo
from p2ptrain.evaluation import evaluate
from p2ptrain.inner import inner_lr, inner_step, make_optimizer, round_warmup
from p2ptrain.models import build_model
from p2ptrain.verify import (
    CALIBRATION_MARGIN,
    MAX_TOLERANCE,
    Outcome,
    Report,
    calibrate,
    class_pair,
    commitment,
    distance,
    judge,
    refereed,
    sketch,
    sketch_seed,
    tolerance,
    wire,
)

ROOT = Path(__file__).resolve().parent.parent
FP32, BF16 = "cpu/float32", "cpu/bfloat16"
HONEST = {"fp32_1_thread": (FP32, 1), "fp32_2_threads": (FP32, 2), "bf16": (BF16, 2)}


class Replayer:
    """Recomputes one shard of one round from given params, as a verifiable round does."""

    def __init__(self, cfg, corpus: Corpus, shards: int):
        self.cfg, self.corpus, self.shards = cfg, corpus, shards
        self.model = build_model(cfg.model.name, cfg.model.context_length, seed=cfg.run.seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def delta(
        self,
        start: list[torch.Tensor],
        round: int,
        shard: int,
        *,
        dtype: torch.dtype = torch.float32,
        threads: int = 2,
        steps: int | None = None,
        poison: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        cfg = self.cfg.inner
        steps = cfg.num_inner_steps if steps is None else steps
        torch.set_num_threads(threads)
        with torch.no_grad():
            for p, s in zip(self.params, start):
                p.copy_(s)
        optimizer = make_optimizer(self.params, cfg)  # fresh each round: replicas start alike
        starts = self.corpus.shard(seed=self.cfg.run.seed, round=round, rank=shard, world=self.shards)
        batches = self.corpus.batches(starts, cfg.batch_size)
        for step in range(steps):
            x, y = next(batches)
            if poison is not None:
                x, y = poison(x), poison(y)
            # The lr of a verifiable round: a function of (round, step) only.
            lr = inner_lr(cfg, round * cfg.num_inner_steps + step)
            lr *= round_warmup(step, self.cfg.verification.round_warmup_steps)
            inner_step(
                self.model, self.params, optimizer, x, y, lr=lr, grad_clip=cfg.grad_clip, autocast_dtype=dtype
            )
        with torch.no_grad():
            return [s - p.detach().float() for s, p in zip(start, self.params)]


def shuffled(t: torch.Tensor) -> torch.Tensor:
    """Poisoned data: every sequence's tokens in a fixed random order."""
    order = torch.randperm(t.shape[-1], generator=torch.Generator().manual_seed(0))
    return t[..., order]


def noise_like(d: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    noise = [torch.randn(t.shape, generator=gen) for t in d]
    scale = float(torch.cat([t.reshape(-1) for t in d]).norm()) / float(
        torch.cat([t.reshape(-1) for t in noise]).norm()
    )
    return [n * scale for n in noise]


def drip(d: list[torch.Tensor], bias: list[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    norm = float(torch.cat([t.reshape(-1) for t in d]).norm())
    return [t + fraction * norm * b for t, b in zip(d, bias)]


def run(rounds: int, seeds: int, shards: int, grace: int, honest_seeds: int | None = None) -> dict:
    honest_seeds = seeds if honest_seeds is None else honest_seeds
    cfg = load_config(ROOT / "configs" / "default.yaml")
    corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    replayer = Replayer(cfg, corpus, shards)
    swarm_model = build_model(cfg.model.name, cfg.model.context_length, seed=cfg.run.seed)
    diloco = DiLoCo(swarm_model, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov)
    # A fixed direction of unit norm: the drip adds the same bias every round.
    gen = torch.Generator().manual_seed(12345)
    bias = [torch.randn(m.shape, generator=gen) for m in diloco.master]
    unit = float(torch.cat([b.reshape(-1) for b in bias]).norm())
    bias = [b / unit for b in bias]
    # Every comparison: (round, what was compared, the two reports); judged at the end under each policy.
    comparisons: list[tuple[int, str, list[Report]]] = []
    refereed_ok = {"convicted_right": 0, "runs": 0}
    previous: list[torch.Tensor] | None = None
    t0 = time.monotonic()

    codec = codec_for(cfg.averaging)

    def compare(
        name: str,
        a: tuple[str, list[torch.Tensor]],
        b: tuple[str, list[torch.Tensor]],
        r: int,
        n: int = seeds,
    ):
        # As a verifiable round compares them: what each would send (the run's codec), sealed, then sketched.
        # Tensor by tensor (averaging.packed=false): packing moves the same decoded values into other parts,
        # which changes the sketch's buckets but not what it estimates (the distance of the two vectors).
        wa, wb = wire(a[1], codec), wire(b[1], codec)
        commits = [commitment(wa.digests), commitment(wb.digests)]
        for s in range(n):
            seed = sketch_seed(f"bench-{s}", r, commits)
            reports = [
                Report("a", a[0], sketch(wa.parts, seed), 0.0),
                Report("b", b[0], sketch(wb.parts, seed), 0.0),
            ]
            comparisons.append((r, name, reports))

    for r in range(rounds):
        start = [m.clone() for m in diloco.master]
        honest = {
            name: (cls, replayer.delta(start, r, 0, dtype=getattr(torch, cls.split("/")[1]), threads=threads))
            for name, (cls, threads) in HONEST.items()
        }
        reference = honest["fp32_1_thread"][1]
        h = cfg.inner.num_inner_steps
        attacks = {
            "wrong_shard": replayer.delta(start, r, 1),
            "lazy_third_x3": [3 * t for t in replayer.delta(start, r, 0, steps=max(1, h // 3))],
            "poisoned_data": replayer.delta(start, r, 0, poison=shuffled),
            "zero": [torch.zeros_like(t) for t in reference],
            "sign_flip": [-t for t in reference],
            "x10": [10 * t for t in reference],
            "noise": noise_like(reference, seed=r),
            "drip_1pct": drip(reference, bias, 0.01),
            "drip_5pct": drip(reference, bias, 0.05),
            "drip_20pct": drip(reference, bias, 0.20),
        }
        if previous is not None:
            attacks["stale"] = previous
        names = list(honest)
        for i, x in enumerate(names):
            for y in names[i + 1 :]:
                compare(f"honest:{x}~{y}", honest[x], honest[y], r, honest_seeds)
        for attack, d in attacks.items():
            for name in names:
                compare(attack, honest[name], (FP32, d), r)
        # Two colluders with the same wrong pseudo-gradient and one honest replica: the group dissents; a
        # referee (another honest recomputation) convicts both colluders and not the honest peer.
        right, wrong = wire(reference, codec), wire(attacks["wrong_shard"], codec)
        seed = sketch_seed(
            "bench-colluders", r, [commitment(right.digests)] + [commitment(wrong.digests)] * 2
        )
        group = [
            Report("honest", FP32, sketch(right.parts, seed), 0.0),
            Report("x", FP32, sketch(wrong.parts, seed), 0.0),
            Report("y", FP32, sketch(wrong.parts, seed), 0.0),
        ]
        refereed_ok["dissent"] = refereed_ok.get("dissent", 0) + (judge(group).outcome == Outcome.DISSENT)
        referee_wire = wire(honest["fp32_2_threads"][1], codec)
        referee = Report("referee", FP32, sketch(referee_wire.parts, seed), 0.0)
        refereed_ok["runs"] += 1
        refereed_ok["convicted_right"] += refereed(group, referee) == {"x", "y"}
        previous = reference
        # The swarm's step: the honest average of its shards (shard 0 here stands for all of them).
        diloco.outer_step(reference)
        print(json.dumps({"round": r, "seconds": round(time.monotonic() - t0, 1)}), flush=True)

    val = evaluate(swarm_model, corpus, cfg, torch.device("cpu"))["val_loss"]
    return {
        "rounds": rounds,
        "grace_rounds": grace,
        "sketches_per_pair": seeds,
        "sketches_per_honest_pair": honest_seeds,
        "wire": cfg.averaging.compression,
        "shards": shards,
        "trajectory_val_loss": round(val, 4),
        # Both judged over the rounds after the grace rounds. Static: the defaults of verify.tolerance.
        "static": summarize(comparisons, lambda r, a, b: tolerance(a, b), first_round=grace),
        # Calibrated per class pair from the pairs that agreed in the last WINDOW rounds (grace rounds
        # included): what a peer can know, attackers that went unnoticed included.
        "calibrated": summarize(comparisons, calibrated(comparisons), first_round=grace),
        "referee": refereed_ok,
        "wall_s": round(time.monotonic() - t0, 1),
    }


WINDOW = 10
"""Rounds of honest agreement a calibrated tolerance looks back on."""


def calibrated(comparisons: list[tuple[int, str, list[Report]]]) -> Callable[[int, str, str], float]:
    """Tolerance(round, class, class), learnt round by round from the pairs (honest or not: a peer cannot
    tell) that agreed under the tolerance of their own round, in the previous ``WINDOW`` rounds."""
    by_round: dict[int, list[tuple[tuple[str, str], float]]] = {}
    for r, _, (a, b) in comparisons:
        key = class_pair(a.numeric_class, b.numeric_class)
        by_round.setdefault(r, []).append((key, distance(a.sketch, b.sketch)))
    agreed: list[tuple[int, tuple[str, str], float]] = []
    tolerances: dict[tuple[int, tuple[str, str]], float] = {}
    for r in sorted(by_round):
        for key, d in by_round[r]:
            if (r, key) not in tolerances:
                seen = [x for rr, k, x in agreed if k == key and r - WINDOW <= rr < r]
                tolerances[(r, key)] = calibrate(seen, floor=tolerance(*key))
            if d <= tolerances[(r, key)]:
                agreed.append((r, key, d))

    def tol(r: int, a: str, b: str) -> float:
        key = class_pair(a, b)
        return tolerances.get((r, key), tolerance(a, b))

    return tol


def summarize(
    comparisons: list[tuple[int, str, list[Report]]],
    tol: Callable[[int, str, str], float],
    *,
    first_round: int,
) -> dict:
    """Per compared pair: comparisons, dissents (detections, or false positives for honest pairs), distances."""
    out: dict[str, dict] = {}
    for r, name, reports in comparisons:
        if r < first_round:
            continue
        a, b = reports
        pair = class_pair(a.numeric_class, b.numeric_class)
        verdict = judge(reports, {pair: tol(r, *pair)})
        d = next(iter(verdict.distances.values()))
        entry = out.setdefault(name, {"comparisons": 0, "dissent": 0, "distance_min": d, "distance_max": d})
        entry["comparisons"] += 1
        entry["dissent"] += verdict.outcome == Outcome.DISSENT
        entry["distance_min"] = min(entry["distance_min"], d)
        entry["distance_max"] = max(entry["distance_max"], d)
    for entry in out.values():
        entry["rate"] = round(entry["dissent"] / entry["comparisons"], 4)
        entry["distance_min"], entry["distance_max"] = (
            round(entry["distance_min"], 5),
            round(entry["distance_max"], 5),
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=4, help="independent sketches per compared pair")
    parser.add_argument(
        "--honest-seeds",
        type=int,
        default=40,
        help="independent sketches per honest pair (3,000 comparisons or more bound false positives at 0.001)",
    )
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--grace", type=int, default=5, help="rounds of calibration before verdicts count")
    args = parser.parse_args(argv)
    result = run(args.rounds, args.seeds, args.shards, args.grace, args.honest_seeds)
    result["machine"] = {"cpus": torch.get_num_threads(), "platform": platform.platform()}
    merge_results("verification.json", "replicas", result)

    rows = [
        "| pair compared | distance (min – max) | static tolerances: dissent | calibrated: dissent |",
        "| --- | --- | ---: | ---: |",
    ]
    static, tuned = result["static"], result["calibrated"]
    for name, s in static.items():
        c = tuned.get(name, {"dissent": 0, "comparisons": 0, "rate": 0.0})
        rows.append(
            f"| {name} | {s['distance_min']:.2g} – {s['distance_max']:.2g} "
            f"| {s['dissent']} of {s['comparisons']} ({s['rate']:.3f}) "
            f"| {c['dissent']} of {c['comparisons']} ({c['rate']:.3f}) |"
        )
    ref = result["referee"]
    rows.append("")
    rows.append(
        f"{args.rounds} rounds of configs/default.yaml along the swarm's trajectory, each pseudo-gradient "
        f"compared as it goes on the wire ({result['wire']}), {args.seeds} sketches per "
        f"attacker pair and {args.honest_seeds} per honest pair; each attacker is compared with each of the 3 "
        "honest replicas (fp32 on 1 and 2 threads, bf16), "
        "and honest lines count false positives. Static: verify.py's default tolerances (0.02 within a "
        "numeric class, 0.15 across). Calibrated: per class pair, "
        f"{CALIBRATION_MARGIN} × the largest distance of the pairs that agreed in the last {WINDOW} rounds "
        f"(attackers that went unnoticed included), at least the default and at most {MAX_TOLERANCE}. Both "
        f"judged after {args.grace} grace rounds. Colluders: two "
        "with the same wrong pseudo-gradient beside an honest replica dissented in "
        f"{ref.get('dissent', 0)} of {ref['runs']} "
        f"rounds, and a referee convicted exactly the two in {ref['convicted_right']} of {ref['runs']}."
    )
    replace_block("replicas", rows, DOC)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
