"""Verification benchmark: real peers of a verifiable run (verification.replicas = 2), one or two of them
hostile (``bench/cheat.py``), on 127.0.0.1 with a swarm key.

Runs, one after another (never two at once: they share the machine's cores):

* the all-honest swarm at k = 1 (robust aggregation only) and at k = 2, 4 peers each; at k = 1 with a fresh
  AdamW every round (``bench/fresh_inner.py``: what verifiable rounds' optimizer costs, apart from
  replicated shards); and 3 honest peers at k = 2 (a swarm without the attacker's compute);
* every attack of ``bench/cheat.py`` at k = 2, 1 hostile peer of 4 (the colluders: 2 of 5);
* honest replicas that differ in thread count and in dtype (fp32 on 1 and 2 threads, bf16), at k = 2;
* the overhead once every peer is trusted: 4 honest peers, ``verification.rounds_to_trust`` 3; with those
  settings, 1 of 4 attacking (``TRUSTED_ATTACKS``): what an attack costs once replication can end; and 3
  honest peers alone with them (what the swarm can do without the attacker's compute); and those runs again
  over ``LONG_ROUNDS`` rounds.

Read from the honest peers' logs: the rounds in which a hostile peer's work was judged and whether it
counted, the round it was banned in, strikes against honest peers, every honest pair's sketch distance,
and the final validation loss of an honest peer's model.

    python -m bench.verification [--config configs/default.yaml] [--attacks sign_flip_x10,zero] [--quick]

Writes the ``real_peers`` part of bench/results/verification.json and the verification table in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.cheat import ATTACKS
from bench.report import DOC, merge_results, replace_block
from p2ptrain.config import load_config
from p2ptrain.evaluation import Evaluator
from p2ptrain.localswarm import closed_swarm_join, run_swarm

ROOT = Path(__file__).resolve().parent.parent
PEERS = 4
TRUSTED_ATTACKS = ("sign_flip_x10", "wrong_shard")
"""Attacks also run with trust earned in 3 rounds (one caught by robust aggregation too, one only by replicas)."""
LONG_ROUNDS = 48
"""The trusted runs again over this many rounds: does the attacker's cost shrink as the run goes on?"""
EQUAL_SAMPLES_ROUNDS = LONG_ROUNDS * (PEERS - 1) // PEERS
"""4 honest peers train in this many rounds the samples that 3 train in ``LONG_ROUNDS``."""
WHAT = {
    "sign_flip_x10": "−10 × its pseudo-gradient",
    "x10": "10 × its pseudo-gradient",
    "noise": "noise, 10 × the norm",
    "zero": "zeros (free rider)",
    "wrong_shard": "trains other data than its shard",
    "lazy": "a third of the steps, scaled up 3 ×",
    "stale": "its previous round's pseudo-gradient",
    "poisoned": "its shard with shuffled targets",
    "colluder": "two colluders, the same −10 × work",
    "drip": "a bias of 1 % of the norm",
    "claim_weight": "sends its group's whole weight",
    "copy_sketch": "seals −10 ×, publishes its partner's sketch",
    "send_other": "seals honestly, sends −10 ×",
}


def swarm(
    config: Path,
    workdir: Path,
    *,
    replicas: int,
    hostile: dict[int, str] | None = None,
    peers: int = PEERS,
    sets: list[str] = (),  # type: ignore[assignment]
    peer_sets: dict[int, list[str]] | None = None,
    module: str = "p2ptrain",
) -> dict[str, Any]:
    """Run one swarm to its end; what the honest peers' logs and final models show. ``module``: what every
    honest peer runs (bench.fresh_inner: a fresh AdamW every round)."""
    hostile, peer_sets = hostile or {}, peer_sets or {}
    base, _ = closed_swarm_join(
        workdir,
        config,
        [
            f"run.run_id=verify-{workdir.name}-{int(time.time())}",
            f"swarm.min_peers={peers}",
            f"averaging.target_group_size={peers}",
            f"verification.replicas={replicas}",
            "device.num_threads=1",
            *sets,
        ],
    )
    t0 = time.monotonic()
    cheats = {i: ("bench.cheat", [hostile[i]]) if i in hostile else (module, []) for i in range(peers)}
    extra = {i: [a for item in items for a in ("--set", item)] for i, items in peer_sets.items()}
    procs, codes = run_swarm(base, workdir, peers, hostile=cheats, extra=extra, timeout_s=2400)
    wall_s = time.monotonic() - t0
    honest = [i for i in range(peers) if i not in hostile]
    short = {i: (procs[i].maddr() or "").rsplit("/p2p/", 1)[-1][-8:] for i in range(peers)}
    bad = {short[i] for i in hostile}
    evaluator = Evaluator()
    losses, hashes = [], set()
    for i in honest:
        final = workdir / f"peer{i}" / "final.safetensors"
        if final.exists():
            loaded, metrics = evaluator.file(final)
            losses.append(metrics["val_loss"])
            hashes.add(loaded.params_sha256())
    # The first honest peer's view (every honest peer judges from the same records: checked below).
    views = {i: _view(procs[i].events(), bad) for i in honest}
    view = views[honest[0]]
    # Reducers' refusals are each peer's own (a part it received): the hostile peer is out for good once
    # every honest peer has refused it.
    refused = [v["refused"] for v in views.values()]
    out_for_good = max(refused) if refused and None not in refused else None
    steps = [e for i in honest for e in procs[i].outer_steps()]
    return {
        "replicas": replicas,
        "hostile": sorted(hostile.values()),
        "exit_codes": codes,
        "final_val_loss": max(losses) if len(losses) == len(honest) else None,
        "honest_params_identical": len(losses) == len(honest) and len(hashes) == 1,
        "wall_s": round(wall_s, 1),
        "rounds": len(view["judged"]),
        "attacked_rounds": view["attacked"],
        "hostile_counted_in": view["counted"],
        "hostile_averaged_in": view["averaged"],
        "detected_in_round": min([*view["detected"], *(r for r in refused if r is not None)], default=None),
        "refused_by_reducers_in_round": [r for r in refused],
        "banned_in_round": min((r for r in (view["banned"], out_for_good) if r is not None), default=None),
        "honest_struck": sorted({p for v in views.values() for p in v["struck"]} - bad),
        "honest_pairs": [d for v in views.values() for d in v["honest_distances"]],
        "honest_dissents": sum(v["honest_dissents"] for v in views.values()),
        "views_agree": len({json.dumps(v["judged"], sort_keys=True) for v in views.values()}) == 1,
        "duplicate_work": view["duplicate_work"],
        "mean_round_s": round(sum(float(e.get("duration_s", 0)) for e in steps) / max(len(steps), 1), 2),
        "inner_s": round(sum(float(e.get("inner_s", 0)) for e in steps) / max(len(steps), 1), 2),
    }


def _view(events: list[dict], bad: set[str]) -> dict[str, Any]:
    """One honest peer's verdicts, from its log lines."""
    judged: dict[int, dict] = {}
    attacked, counted, detected, struck, averaged = [], [], [], set(), []
    honest_distances, honest_dissents, banned, refused = [], 0, None, None
    duplicate_work = []
    counted_peers: dict[int, int] = {}
    for e in events:
        event = e.get("event", "")
        misbehaved = event == "left a groupmate out" and e.get("fault") == "misbehaved"
        if misbehaved and str(e.get("peer", ""))[-8:] in bad and refused is None:
            refused = int(e["round"])
        r = int(e.get("round", -1))
        # Every peer the verdict counted made the average: the hostile one's parts were in it.
        if event == "outer step" and r in counted_peers and int(e.get("group_size", 0)) == counted_peers[r]:
            averaged.append(r)
        if event == "verified the round":
            r = int(e["round"])
            groups = [*e.get("agreed", []), *e.get("dissent", [])]
            judged[r] = {"agreed": e.get("agreed", []), "dissent": e.get("dissent", [])}
            members = [p for g in groups for p in g]
            in_round = bad & set(members)
            if in_round:
                attacked.append(r)
                if any(bad & set(g) for g in e.get("agreed", [])):
                    counted.append(r)
                    counted_peers[r] = int(e.get("counted", 0))
                else:
                    detected.append(r)
            for pair, d in e.get("distances", {}).items():
                a, b = pair.split("-")
                if not ({a, b} & bad):
                    honest_distances.append(d)
            honest_dissents += sum(1 for g in e.get("dissent", []) if not (set(g) & bad))
            peers = int(e.get("counted", 0)) + sum(len(g) for g in e.get("dissent", []))
            shards = len(groups) + (int(e.get("counted", 0)) - sum(len(g) for g in e.get("agreed", [])))
            if peers:
                duplicate_work.append(round(1 - shards / peers, 3))
        elif event == "a referee settled a dispute":
            struck.update(e.get("convicted", []))
            if bad & set(e.get("banned", [])) and banned is None:
                banned = int(e["round"])
    return {
        "judged": judged,
        "attacked": attacked,
        "counted": counted,
        "detected": detected,
        "struck": struck,
        "banned": banned,
        "refused": refused,
        "averaged": averaged,
        "honest_distances": honest_distances,
        "honest_dissents": honest_dissents,
        "duplicate_work": duplicate_work,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated, or empty")
    parser.add_argument("--quick", action="store_true", help="configs/tiny.yaml, the first attack only")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated runs to measure again (honest/k2, attack/send_other...), the others kept from "
        "bench/results/verification.json; each run records the commit it was measured at",
    )
    args = parser.parse_args(argv)
    only = {r for r in args.only.split(",") if r}
    config = (ROOT / "configs" / "tiny.yaml" if args.quick else args.config).resolve()
    attacks = [a for a in args.attacks.split(",") if a][: 1 if args.quick else None]
    logs = ROOT / "runs" / "bench-verification"
    runs: dict[str, dict] = {}
    if only:
        runs = json.loads((ROOT / "bench" / "results" / "verification.json").read_text())["real_peers"][
            "runs"
        ]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)

    def record(name: str, run: Callable[[], dict]) -> None:
        if only and name not in only:
            return
        runs[name] = result = {**run(), "commit": commit.stdout.strip()}
        print(
            json.dumps({"run": name, **{k: v for k, v in result.items() if k != "honest_pairs"}}), flush=True
        )

    record("honest/k1", lambda: swarm(config, logs / "honest-k1", replicas=1))
    record("honest/k2", lambda: swarm(config, logs / "honest-k2", replicas=2))
    if not args.quick:  # what a fresh AdamW every round costs, apart from replicated shards
        fresh = functools.partial(
            swarm, config, logs / "honest-k1-fresh", replicas=1, module="bench.fresh_inner"
        )
        record("honest/k1_fresh_adamw", fresh)
    if not args.quick:  # what the swarm can do once a hostile peer is out: three honest peers
        record("honest/k2_3peers", lambda: swarm(config, logs / "honest-k2-3", replicas=2, peers=PEERS - 1))
    for attack in attacks:
        colluders = attack == "colluder"
        hostile = {3: attack, 4: attack} if colluders else {PEERS - 1: attack}
        peers = PEERS + 1 if colluders else PEERS
        run = functools.partial(swarm, config, logs / attack, replicas=2, peers=peers, hostile=hostile)
        record(f"attack/{attack}", run)
    if not args.quick:
        mixed = {1: ["device.num_threads=2"], 3: ["device.dtype=bfloat16"]}
        record("honest/threads_and_bf16", lambda: swarm(config, logs / "mixed", replicas=2, peer_sets=mixed))
        trusted = ["verification.rounds_to_trust=3", "verification.audit_fraction=0.1"]
        record("honest/trusted", lambda: swarm(config, logs / "trusted", replicas=2, sets=trusted))
        # The floor of an attack once trust ends replication: the swarm without the attacker's compute.
        record(
            "honest/trusted_3peers",
            lambda: swarm(config, logs / "trusted-3", replicas=2, peers=PEERS - 1, sets=trusted),
        )
        # The acceptance's "1 of 4 attacking, within 2% of all-honest", where trust comes early enough for the
        # swarm's replication to end: against honest/trusted, the same settings.
        for attack in TRUSTED_ATTACKS:
            run = functools.partial(
                swarm,
                config,
                logs / f"trusted-{attack}",
                replicas=2,
                hostile={PEERS - 1: attack},
                sets=trusted,
            )
            record(f"trusted/{attack}", run)
        # The same over a run three times as long: is the gap to all honest the start's, made up later?
        long = [*trusted, f"outer.num_rounds={LONG_ROUNDS}"]
        record("long/honest", lambda: swarm(config, logs / "long", replicas=2, sets=long))
        record("long/3peers", lambda: swarm(config, logs / "long-3", replicas=2, peers=PEERS - 1, sets=long))
        # 4 honest peers over the rounds in which they train what 3 train in LONG_ROUNDS: is what an attack
        # costs, once banned, the attacker's compute and nothing more?
        equal = [*trusted, f"outer.num_rounds={EQUAL_SAMPLES_ROUNDS}"]
        record(
            "long/honest_equal_samples", lambda: swarm(config, logs / "long-equal", replicas=2, sets=equal)
        )
        for attack in TRUSTED_ATTACKS:
            run = functools.partial(
                swarm, config, logs / f"long-{attack}", replicas=2, hostile={PEERS - 1: attack}, sets=long
            )
            record(f"long/{attack}", run)

    cfg = load_config(config)
    result = {
        "experiment": {
            "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
            "rounds": cfg.outer.num_rounds,
            "inner_steps": cfg.inner.num_inner_steps,
            "peers": PEERS,
            "tolerance": cfg.verification.tolerance,
            "mixed_tolerance": cfg.verification.mixed_tolerance,
            "strikes_to_ban": cfg.verification.strikes_to_ban,
        },
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "runs": runs,
    }
    rows = table(runs, cfg, result["experiment"]["config"])
    print("\n".join(rows))
    if not args.quick:  # a smoke test of the harness, not a result
        merge_results("verification.json", "real_peers", result)
        replace_block("verification", rows, DOC)


def table(runs: dict[str, dict], cfg, config_name: str) -> list[str]:
    base = runs["honest/k2"]["final_val_loss"]

    def loss(r: dict) -> str:
        if r["final_val_loss"] is None or not r["honest_params_identical"]:
            return f"honest peers did not all finish alike: exit {r['exit_codes']}"
        ratio = f" ({r['final_val_loss'] / base - 1:+.1%})" if base else ""
        return f"{r['final_val_loss']:.3f}{ratio}"

    rows = [
        "| the hostile peer | its work judged in rounds | counted by the verdict in | in an average in "
        "| detected in round | banned in round | honest peers struck | val loss (vs honest k = 2) |",
        "| --- | --- | --- | --- | ---: | ---: | --- | ---: |",
    ]
    for name in ("honest/k1", "honest/k1_fresh_adamw", "honest/k2", "honest/k2_3peers"):
        if name not in runs:
            continue
        r = runs[name]
        who = {
            "honest/k2_3peers": "none, 3 honest peers only",
            "honest/k1_fresh_adamw": "none, a fresh AdamW every round",
        }.get(name, "none")
        rows.append(f"| {who}, k = {r['replicas']} | | | | | | {r['honest_struck'] or 'none'} | {loss(r)} |")
    for name, r in runs.items():
        if not name.startswith("attack/"):
            continue
        attack = name.split("/", 1)[1]
        rows.append(
            f"| {WHAT.get(attack, attack)} | {_rounds(r['attacked_rounds'])} | {_rounds(r['hostile_counted_in'])} "
            f"| {_rounds(r.get('hostile_averaged_in', []))} | {_or_dash(r['detected_in_round'])} "
            f"| {_or_dash(r['banned_in_round'])} "
            f"| {r['honest_struck'] or 'none'} | {loss(r)} |"
        )
    rows.append("")
    pairs = [d for r in runs.values() for d in r["honest_pairs"]]
    dissents = sum(r["honest_dissents"] for r in runs.values())
    mixed, trusted = runs.get("honest/threads_and_bf16"), runs.get("honest/trusted")
    rows.append(
        f"{cfg.outer.num_rounds} rounds of {cfg.inner.num_inner_steps} inner steps of {config_name}, 4 peers "
        "(the colluders: 5), verification.replicas 2, every peer on 1 thread unless said. Rounds count from 0; "
        "the hostile peer attacks in every round it trains. Honest replica pairs compared over all runs: "
        f"{len(pairs)}, largest distance {max(pairs, default=0):.4f}, dissents between honest peers: {dissents}."
    )
    if mixed:
        mixed_pairs = mixed["honest_pairs"]
        rows.append(
            f"Honest replicas on 1 and 2 threads and in bf16: {len(mixed_pairs)} pairs, largest distance "
            f"{max(mixed_pairs, default=0):.4f}, honest dissents {mixed['honest_dissents']}, struck "
            f"{mixed['honest_struck'] or 'none'}; val loss {loss(mixed)}."
        )
    if trusted:
        work = trusted["duplicate_work"]
        late = work[len(work) // 2 :]
        k1 = "; ".join(
            f"{r['mean_round_s']} s ({r['inner_s']} s)" for n, r in runs.items() if n.startswith("honest/k1")
        )
        rows.append(
            "Overhead once trusted (rounds_to_trust 3, audit_fraction 0.1): share of inner work that is a "
            f"replica's, by round: {work}; over the second half of the run "
            f"{sum(late) / max(len(late), 1):.1%}. Mean round (inner phase) {trusted['mean_round_s']} s "
            f"({trusted['inner_s']} s), against k = 1: {k1}."
        )
        attacked = [(n.split("/", 1)[1], r) for n, r in runs.items() if n.startswith("trusted/")]
        if attacked and trusted["final_val_loss"]:
            each = "; ".join(
                f"{WHAT.get(a, a)}: detected in round {_or_dash(r['detected_in_round'])}, banned in round "
                f"{_or_dash(r['banned_in_round'])}, honest struck {r['honest_struck'] or 'none'}, val loss "
                f"{r['final_val_loss']:.3f} ({r['final_val_loss'] / trusted['final_val_loss'] - 1:+.1%} against "
                "them all honest)"
                for a, r in attacked
            )
            rows.append(f"1 of 4 attacking, the same settings (rounds_to_trust 3): {each}.")
        three = runs.get("honest/trusted_3peers")
        if three and three["final_val_loss"] and trusted["final_val_loss"]:
            rows.append(
                f"3 honest peers alone, the same settings (the swarm without the attacker's compute): val loss "
                f"{three['final_val_loss']:.3f} ({three['final_val_loss'] / trusted['final_val_loss'] - 1:+.1%} "
                "against 4 honest peers)."
            )
    honest = runs.get("long/honest")
    if honest and honest["final_val_loss"]:

        def against(r: dict, base: dict = honest) -> str:
            if not r["final_val_loss"]:
                return f"did not finish alike: exit {r['exit_codes']}"
            return f"val loss {r['final_val_loss']:.3f} ({r['final_val_loss'] / base['final_val_loss'] - 1:+.1%})"

        apart = ("long/honest", "long/3peers", "long/honest_equal_samples")
        attacked = {n: r for n, r in runs.items() if n.startswith("long/") and n not in apart}
        each = [
            f"{WHAT.get(n.split('/', 1)[1], n)}: detected in round {_or_dash(r['detected_in_round'])}, banned in "
            f"round {_or_dash(r['banned_in_round'])}, honest struck {r['honest_struck'] or 'none'}, {against(r)}"
            for n, r in attacked.items()
        ]
        three = runs.get("long/3peers")
        rows.append(
            f"The same settings over {LONG_ROUNDS} rounds: all honest, val loss {honest['final_val_loss']:.3f}; "
            + (f"3 honest peers alone, {against(three)}; " if three else "")
            + "; ".join(each)
            + "."
        )
        equal = runs.get("long/honest_equal_samples")
        if equal and equal["final_val_loss"]:
            named = {
                "long/honest": f"4 honest peers over {LONG_ROUNDS} rounds",
                "long/3peers": "3 honest peers",
            }
            named |= {n: WHAT.get(n.split("/", 1)[1], n) for n in attacked}
            rows.append(
                f"At equal samples: 4 honest peers over {EQUAL_SAMPLES_ROUNDS} rounds (what 3 train in "
                f"{LONG_ROUNDS}), val loss {equal['final_val_loss']:.3f}; against it, "
                + "; ".join(f"{name}: {against(runs[n], equal)}" for n, name in named.items() if n in runs)
                + "."
            )
    return rows


def _rounds(rounds: list[int]) -> str:
    return ", ".join(map(str, rounds)) or "none"


def _or_dash(x) -> str:
    return "—" if x is None else str(x)


if __name__ == "__main__":
    main()
