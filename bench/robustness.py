"""Robust aggregation benchmark: one insider of four sends something else than its pseudo-gradient.

Two parts, in one go:

* **Simulated** (``bench/simulate.py``: p2ptrain's DiLoCo, model, data and aggregator in one process, one
  group of four): every attack of ``bench/tamper.py`` against the plain mean and against CenteredClip,
  and the attack-free run under each.
* **Real peers**: four `p2ptrain join` processes with a swarm key on 127.0.0.1, one of them
  ``python -m bench.tamper ATTACK join ...`` (a real peer that trains its shard but sends ATTACK(delta)).
  The attack-free swarm, then the attacked one under CenteredClip, then under the plain mean.

Reported: the final validation loss of an honest peer's model, and its ratio to the attack-free run's.

    python -m bench.robustness [--config configs/default.yaml] [--only-sim] [--real-attacks sign_flip_x10]

Writes the ``robust_aggregation`` part of bench/results/verification.json and the robustness table in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from bench.report import DOC, merge_results, replace_block
from bench.simulate import simulate
from bench.tamper import ATTACKS
from p2ptrain.config import load_config
from p2ptrain.evaluation import Evaluator
from p2ptrain.localswarm import closed_swarm_join, run_swarm

ROOT = Path(__file__).resolve().parent.parent
PEERS = 4
AGGREGATORS = ("mean", "centered_clip")
WHAT = {
    "none": "no attacker",
    "sign_flip_x10": "-10 × its pseudo-gradient",
    "x10": "10 × its pseudo-gradient",
    "noise": "noise, 10 × the pseudo-gradient's norm",
    "zero": "zeros (a free rider)",
}


def simulated(config: Path) -> dict:
    runs: dict[str, dict] = {}
    for aggregator in AGGREGATORS:
        cfg = load_config(config, {"averaging": {"aggregator": aggregator}})
        for attack in ["none", *ATTACKS]:
            t0 = time.monotonic()
            out = simulate(cfg, PEERS, None if attack == "none" else attack)
            runs[f"{aggregator}/{attack}"] = {
                "aggregator": aggregator,
                "attack": attack,
                "final_val_loss": out["val_loss"],
                "wall_s": round(time.monotonic() - t0, 1),
            }
            print(json.dumps(runs[f"{aggregator}/{attack}"]), flush=True)
    return runs


def real(config: Path, attack: str, aggregator: str, workdir: Path) -> dict:
    """Four `p2ptrain join` peers, the last of them hostile unless ``attack`` is none."""
    base, _ = closed_swarm_join(
        workdir,
        config,
        [
            f"run.run_id=robust-{attack}-{aggregator}-{int(time.time())}",
            f"swarm.min_peers={PEERS}",
            f"averaging.target_group_size={PEERS}",
            f"averaging.aggregator={aggregator}",
            "device.num_threads=1",
        ],
    )
    t0 = time.monotonic()
    hostile = {PEERS - 1: ("bench.tamper", [attack])} if attack != "none" else {}
    peers, codes = run_swarm(base, workdir, PEERS, hostile=hostile)
    wall_s = time.monotonic() - t0
    honest = range(PEERS - 1 if attack != "none" else PEERS)
    evaluator = Evaluator()
    losses, hashes = [], set()
    for i in honest:
        final = workdir / f"peer{i}" / "final.safetensors"
        if final.exists():
            loaded, metrics = evaluator.file(final)
            losses.append(metrics["val_loss"])
            hashes.add(loaded.params_sha256())
    steps = [e for i in honest for e in peers[i].outer_steps()]
    named = {
        peer
        for i in honest
        for e in peers[i].events()
        if e.get("event", "").startswith("left groupmates' parts out of the aggregate")
        for peer in e.get("parts_by_peer", {})
    }
    maddr = peers[-1].maddr() if attack != "none" else None  # the log lines carry a short peer id only
    hostile_id = maddr.rsplit("/p2p/", 1)[-1] if maddr else None
    return {
        "aggregator": aggregator,
        "attack": attack,
        "exit_codes": codes,
        "final_val_loss": max(losses) if len(losses) == len(honest) else None,
        "honest_params_identical": len(losses) == len(honest) and len(hashes) == 1,
        "mean_group_size": round(sum(int(e.get("group_size", 0)) for e in steps) / max(len(steps), 1), 2),
        # Parts the honest peers' reducers left out of the aggregate, and whom they named for it.
        "outlier_parts": sum(int(e.get("outlier_parts", 0)) for e in steps),
        "named_only_the_hostile_peer": bool(named) and named == {hostile_id},
        "named_an_honest_peer": bool(named - {hostile_id}),
        "wall_s": round(wall_s, 1),
    }


def ratio(loss: float | None, base: float | None) -> str:
    return "—" if loss is None or base is None else f"{loss / base:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--real-attacks", default=",".join(ATTACKS), help="comma-separated, or empty")
    parser.add_argument("--only-sim", action="store_true")
    args = parser.parse_args(argv)
    config = args.config.resolve()

    sim = simulated(config)
    runs: dict[str, dict] = {}
    if not args.only_sim:
        logs = ROOT / "runs" / "bench-robustness"
        # Every attack under the default aggregator; the first also under the mean, as the control.
        attacks = [a for a in args.real_attacks.split(",") if a]
        plan = (
            [("none", "centered_clip")]
            + [(a, "centered_clip") for a in attacks]
            + [(a, "mean") for a in attacks[:1]]
        )
        for attack, aggregator in plan:
            runs[f"{aggregator}/{attack}"] = r = real(
                config, attack, aggregator, logs / f"{aggregator}-{attack}"
            )
            print(json.dumps(r), flush=True)

    cfg = load_config(config)
    result = {
        "experiment": {
            "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
            "rounds": cfg.outer.num_rounds,
            "inner_steps": cfg.inner.num_inner_steps,
            "peers": PEERS,
            "attackers": 1,
            "clip_radius": cfg.averaging.clip_radius,
        },
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "simulated": sim,
        "real": runs,
    }
    merge_results("verification.json", "robust_aggregation", result)

    rows = [
        "| the hostile peer (1 of 4) sends | simulated: mean | simulated: centered_clip "
        "| real peers: mean | real peers: centered_clip |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    base = {a: sim[f"{a}/none"]["final_val_loss"] for a in AGGREGATORS}
    real_base = runs.get("centered_clip/none", {}).get("final_val_loss")
    for attack in ["none", *ATTACKS]:
        cells = []
        for aggregator in AGGREGATORS:
            loss = sim[f"{aggregator}/{attack}"]["final_val_loss"]
            cells.append(f"{loss:.3f} ({ratio(loss, base['mean'])})")
        for aggregator in AGGREGATORS:
            r = runs.get(f"{aggregator}/{attack}")
            if r is None:
                cells.append("")
            elif r["final_val_loss"] is None or not r["honest_params_identical"]:
                cells.append(f"exit {r['exit_codes']}")
            else:
                left_out = f"; {r['outlier_parts']} parts left out" if aggregator == "centered_clip" else ""
                named = ", only it named" if r["named_only_the_hostile_peer"] else ""
                named = ", AN HONEST PEER NAMED" if r["named_an_honest_peer"] else named
                cells.append(
                    f"{r['final_val_loss']:.3f} ({ratio(r['final_val_loss'], real_base)}{left_out}{named})"
                )
        rows.append(f"| {WHAT[attack]} | " + " | ".join(cells) + " |")
    rows.append("")
    rows.append(
        f"Final validation loss of an honest peer's model ({cfg.outer.num_rounds} rounds of "
        f"{cfg.inner.num_inner_steps} inner steps of {result['experiment']['config']}, 4 peers in one group), "
        "and in brackets its ratio to the attack-free run (simulated: under the mean; real peers: under "
        "centered_clip), then for real peers the parts of the pseudo-gradient that the three honest peers' "
        "reducers left out of the aggregate over the run, and whom their logs named for it. "
        f"clip_radius {cfg.averaging.clip_radius}, reject_radius {cfg.averaging.reject_radius}."
    )
    replace_block("robustness", rows, DOC)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
