"""Attack benchmark: two honest `p2ptrain join` peers with a swarm key (configs/tiny.yaml, real processes on
127.0.0.1), once without an attacker and once beside each hostile peer of bench/hostile.py, in one go.

Reported for each attack: what the honest peers did (exit codes, identical final params), their final
validation loss against the attack-free run's, honest peer-rounds lost (an outer step that did not average
with the other honest peer: a fallback, a stale drop, or a group without it), the waits it cost (barrier
timeouts, failed averaging attempts) and what the hostile peer saw. Attack 8 (a crafted model file) is
`p2ptrain eval` on a file whose metadata is broken.

    python -m bench.attacks [--rounds 8] [--steps 20] [--only weight,nan]

Writes bench/results/attacks.json and the attack table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.hostile import ATTACKS
from bench.report import DOC, replace_block
from p2ptrain.evaluation import Evaluator
from p2ptrain.localswarm import PeerProcess, closed_swarm_join

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CONFIG = ROOT / "configs" / "tiny.yaml"
NUMBERS = {
    "weight": 1,
    "nan": 2,
    "fake_round": 3,
    "download": 4,
    "no_peer": 5,
    "shadow": 6,
    "stall": 7,
    "hold": 9,
}
WHAT = {
    "none": "no attacker",
    "none_again": "no attacker, again (run-to-run spread)",
    "weight": "joins the all-reduce claiming a weight of 1e9, sending noise",
    "nan": "sends parts full of NaN",
    "fake_round": "claims a later round and serves garbage params (checksum right)",
    "download": "an outsider (no key) joins the DHT and downloads the state",
    "no_peer": "an all-gather entry without the `peer` field",
    "shadow": "records in the honest peers' names, and its own, then leaves",
    "stall": "joins the all-reduce and never sends",
    "hold": "accepts the members of the groups it leads and sends them nothing",
}


AVERAGES = ("weight", "nan", "no_peer", "stall", "hold")
"""The attacks made inside a round's all-reduce: one that neither the hostile peer nor its victims saw in an
all-reduce did not take place (its rows would read as harmless)."""


AGAIN = (
    "honest_rounds_lost",
    "final_val_loss",
    "params_identical",
    "exit_codes",
    "failed_attempts",
    "wall_s",
)
"""What a repeated run of an attack keeps (``--repeat``)."""


def run_swarm(attack: str, rounds: int, steps: int, workdir: Path) -> dict:
    run_id = f"attack-{attack}-{int(time.time())}"
    sets = [f"run.run_id={run_id}", f"outer.num_rounds={rounds}", f"inner.num_inner_steps={steps}"]
    # An insider is the third peer: the honest ones start once its record is there (bench.hostile).
    insider = attack in ATTACKS and attack != "download"
    base, key = closed_swarm_join(workdir, CONFIG, sets + [f"swarm.min_peers={3 if insider else 2}"])
    honest: list[PeerProcess] = []
    hostile = None
    t0 = time.monotonic()
    try:
        honest.append(
            PeerProcess(base + ["--set", f"checkpoint.dir={workdir / 'peer0'}"], workdir / "peer0.log")
        )
        first = honest[0].wait_for_maddr(timeout_s=90)
        cmd = base + ["--set", f"checkpoint.dir={workdir / 'peer1'}", "--initial-peers", first]
        honest.append(PeerProcess(cmd, workdir / "peer1.log", index=1))
        if attack in ATTACKS:
            with open(workdir / "hostile.log", "w") as out:
                hostile = subprocess.Popen(
                    [sys.executable, "-m", "bench.hostile", attack, "--config", str(CONFIG)]
                    + ["--initial-peers", first, "--key-file", str(key), "--run-id", run_id],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
        codes = [p.wait(timeout_s=900) for p in honest]
    finally:
        for p in honest:
            p.stop()
        if hostile is not None:
            hostile.terminate()
            try:
                hostile.wait(30)
            except subprocess.TimeoutExpired:
                hostile.kill()
    wall_s = time.monotonic() - t0

    evaluator = Evaluator()
    losses, hashes = [], []
    for i in range(2):
        final = workdir / f"peer{i}" / "final.safetensors"
        if final.exists():
            loaded, metrics = evaluator.file(final)
            losses.append(metrics["val_loss"])
            hashes.append(loaded.params_sha256())
    events = [e for p in honest for e in p.events()]
    steps = [e for p in honest for e in p.outer_steps()]
    lost = sum(1 for e in steps if e.get("fallback") is not None or int(e.get("group_size", 0)) < 2)
    lost += sum(
        1 for e in events if e.get("event") == "the swarm moved past this round: dropping our pseudo-gradient"
    )
    hostile_lines = []
    if (workdir / "hostile.log").exists():
        for line in (workdir / "hostile.log").read_text().splitlines():
            if line.startswith("{") and '"hostile"' in line:
                hostile_lines.append(json.loads(line))
    return {
        "attack": attack,
        "exit_codes": codes,
        "final_val_loss": max(losses) if len(losses) == 2 else None,
        "params_identical": len(hashes) == 2 and len(set(hashes)) == 1,
        "honest_rounds_lost": lost,
        "honest_rounds": 2 * rounds,
        "barrier_timeouts": sum(
            1 for e in events if e.get("event") == "barrier timeout: averaging without slow peers"
        ),
        "failed_attempts": sum(1 for e in events if e.get("event") == "averaging attempt failed"),
        "left_out": sorted(
            {e.get("reason", "")[:80] for e in events if e.get("event") == "left a groupmate out"}
        ),
        "states_loaded": sum(1 for e in events if e.get("event") == "loaded state"),
        "states_refused": sum(1 for e in events if e.get("event") == "refused a state"),
        "hostile": hostile_lines[-3:],
        "wall_s": round(wall_s, 1),
    }


def crafted_model_file(baseline_dir: Path) -> dict:
    """Attack 8: a model file whose metadata says round 'x' and nests its config 10,000 deep."""
    source = baseline_dir / "peer0" / "final.safetensors"
    tensors = load_file(source)
    from safetensors import safe_open

    with safe_open(source, "pt") as f:
        metadata = dict(f.metadata())
    outcomes = {}
    for name, change in {
        "round is not an integer": {"round": "x"},
        "no round": {"round": None},
        "config nested 10,000 deep": {"config": "[" * 10_000 + "]" * 10_000},
    }.items():
        crafted = {k: v for k, v in {**metadata, **change}.items() if v is not None}
        path = baseline_dir / "crafted.safetensors"
        save_file(tensors, path, metadata=crafted)
        out = subprocess.run(
            [sys.executable, "-m", "p2ptrain", "eval", str(path)], capture_output=True, text=True, timeout=120
        )
        lines = [line for line in out.stderr.strip().splitlines() if line]
        outcomes[name] = {"exit_code": out.returncode, "stderr_lines": len(lines), "error": lines[-1][:200]}
    return outcomes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="inner steps per round")
    parser.add_argument("--only", default=",".join(ATTACKS))
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each attack: what an attack costs depends on when the hostile peer's record lands",
    )
    args = parser.parse_args(argv)
    logs = ROOT / "runs" / "bench-attacks"
    runs = {}
    for attack in ["none", "none_again", *[a for a in args.only.split(",") if a]]:
        runs[attack] = run_swarm(attack, args.rounds, args.steps, logs / attack)
        print(json.dumps(runs[attack]), flush=True)
        if attack in ("none", "none_again"):
            continue
        runs[attack]["again"] = []
        for i in range(1, args.repeat):  # the row's figures are the first run's; these its spread
            again = run_swarm(attack, args.rounds, args.steps, logs / f"{attack}.{i}")
            print(json.dumps(again), flush=True)
            runs[attack]["again"].append({k: again[k] for k in AGAIN})
    model_file = crafted_model_file(logs / "none")
    print(json.dumps(model_file), flush=True)

    base_loss = runs["none"]["final_val_loss"]
    result = {
        "benchmark": "attacks",
        "experiment": {
            "config": str(CONFIG.relative_to(ROOT)),
            "rounds": args.rounds,
            "inner_steps": args.steps,
            "honest_peers": 2,
        },
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "runs": runs,
        "model_file": model_file,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "attacks.json").write_text(json.dumps(result, indent=2) + "\n")

    rows = [
        "| # | the hostile peer | honest peers | val loss (vs none) | honest rounds lost | waits "
        "| what the hostile peer saw |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for attack, r in runs.items():
        ok = r["exit_codes"] == [0, 0] and r["params_identical"]
        loss = r["final_val_loss"]
        delta = "" if loss is None or attack == "none" else f" ({loss - base_loss:+.3f})"
        seen = "; ".join(
            str(h.get("outcome") or h.get("state") or h.get("dht") or "")
            for h in r["hostile"]
            if not h.get("started")
        )
        took_place = any(h.get("outcome") for h in r["hostile"]) or r["failed_attempts"] or r["left_out"]
        if attack in AVERAGES and not took_place:  # a staller's own call ends after the run: its victims tell
            seen = "**it never averaged: the attack did not take place**"
        again = r.get("again", [])
        ok = ok and all(a["exit_codes"] == [0, 0] and a["params_identical"] for a in again)
        lost = ", ".join(str(x["honest_rounds_lost"]) for x in [r, *again])
        rows.append(
            f"| {NUMBERS.get(attack, '—')} | {WHAT[attack]} | "
            f"{'finished, identical params' if ok else 'exit ' + str(r['exit_codes'])} | "
            f"{'—' if loss is None else f'{loss:.3f}'}{delta} | {lost} of {r['honest_rounds']} | "
            f"{r['barrier_timeouts']} barrier timeouts, {r['failed_attempts']} failed attempts | {seen[:120]} |"
        )
    refused = all(o["exit_code"] == 1 and o["stderr_lines"] == 1 for o in model_file.values())
    rows.append(
        f"| 8 | a crafted model file ({', '.join(model_file)}) | `p2ptrain eval`: "
        f"{'exit 1, one line each' if refused else json.dumps(model_file)} | | | | |"
    )
    rows.append("")
    rows.append(
        f"{args.rounds} rounds of {args.steps} inner steps of configs/tiny.yaml, 2 honest peers with a swarm key; "
        "the hostile peer holds the key (an insider) except in 4. Val loss: the worse honest peer's final "
        "model. Waits are summed over both honest peers."
        + (
            f" Each attack ran {args.repeat} times: honest rounds lost in each run; the other columns are the "
            "first run's."
            if args.repeat > 1
            else ""
        )
    )
    replace_block("attacks", rows, DOC)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
