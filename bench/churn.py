"""Churn benchmark: the same swarm run twice in one go, once calm and once with peers killed (SIGKILL) and
restarted at random, on the default experiment (real `p2ptrain join` processes on 127.0.0.1).

Reported, side by side: final validation loss (worst peer), whether all peers ended with identical
params, wall time, samples trained, and peer-rounds lost: of peers x rounds possible contributions, how
many never entered an average (the peer was down, loading, or its sync failed).

    python -m bench.churn [--peers 3] [--rounds 20] [--seed 0] [--config configs/default.yaml] [--set k=v]

Writes bench/results/churn.json and the churn table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import time
from pathlib import Path

import torch

from bench.report import DOC, replace_block
from p2ptrain.config import load_config, parse_set
from p2ptrain.evaluation import Evaluator
from p2ptrain.localswarm import LOOPBACK, PeerProcess

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def run_swarm(cfg, config_path: Path, sets: list[str], peers: int, workdir: Path, churn: bool, seed: int):
    rng = random.Random(seed)
    run_id = f"churn-{'on' if churn else 'off'}-{seed}-{int(time.time())}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    base = ["join", "--config", str(config_path), "--host-maddrs", LOOPBACK]
    base += ["--log-format", "json"]
    for item in [
        *sets,
        f"run.run_id={run_id}",
        f"outer.num_rounds={cfg.outer.num_rounds}",
        "device.num_threads=1",
        f"swarm.min_peers={peers}",
        "checkpoint.every_rounds=1",  # a restarted peer resumes from its own last round
    ]:
        base += ["--set", item]

    current: dict[int, PeerProcess] = {}
    all_procs: list[PeerProcess] = []
    starts = {i: 0 for i in range(peers)}
    swarm_round = [0]

    def on_event(_peer: PeerProcess, event: dict) -> None:
        if event.get("event") == "outer step":
            swarm_round[0] = max(swarm_round[0], int(event["round"]) + 1)

    def start(i: int, initial: list[str]) -> PeerProcess:
        cmd = base + ["--set", f"checkpoint.dir={workdir / f'peer{i}'}"]
        for maddr in initial:
            cmd += ["--initial-peers", maddr]
        p = PeerProcess(cmd, workdir / f"peer{i}-{starts[i]}.log", on_event=on_event, index=i)
        starts[i] += 1
        current[i] = p
        all_procs.append(p)
        return p

    def live_maddrs(exclude: int) -> list[str]:
        # Every live peer's address, as a volunteer would pass several: any one of them may die meanwhile.
        found = [
            p.maddr() for j, p in current.items() if j != exclude and p.proc.poll() is None and p.maddr()
        ]
        if not found:
            raise RuntimeError("no live peer to rejoin through")
        return found

    def settled(p: PeerProcess) -> bool:
        return bool(p.outer_steps())

    t0 = time.monotonic()
    kills: list[dict] = []
    down: dict[int, float] = {}  # peer index -> monotonic time to restart it
    try:
        start(0, [])
        while not current[0].maddr():
            time.sleep(0.1)
        for i in range(1, peers):
            start(i, [current[0].maddr()])
        next_kill = time.monotonic() + rng.uniform(15, 35)
        deadline = time.monotonic() + 3600
        while any(p.proc.poll() is None for p in current.values()) or down:
            now = time.monotonic()
            assert now < deadline, "the swarm did not finish within an hour"
            for i, at in list(down.items()):
                if now >= at:
                    del down[i]
                    start(i, live_maddrs(exclude=i))
            # Churn stops 4 rounds before the end, so that the last restarted peer can rejoin and finish.
            if churn and now >= next_kill and swarm_round[0] < cfg.outer.num_rounds - 4:
                alive = [i for i, p in current.items() if p.proc.poll() is None and i not in down]
                # One peer down at a time, and only once every peer is back in the rounds.
                if len(alive) == peers and all(settled(current[i]) for i in alive):
                    victim = rng.choice(alive)
                    current[victim].proc.kill()
                    current[victim].proc.wait()
                    downtime = rng.uniform(5, 20)
                    down[victim] = now + downtime
                    kills.append(
                        {
                            "peer": victim,
                            "at_s": round(now - t0, 1),
                            "round": swarm_round[0],
                            "down_s": downtime,
                        }
                    )
                next_kill = now + rng.uniform(15, 35)
            failed = [p for i, p in current.items() if i not in down and p.proc.poll() not in (None, 0)]
            if failed:
                p = failed[0]
                raise RuntimeError(f"peer {p.index} exited with {p.proc.returncode}; see {p.log_path}")
            time.sleep(0.2)
    finally:
        for p in all_procs:
            p.stop()
    wall_s = time.monotonic() - t0

    evaluator = Evaluator()
    losses, hashes = [], []
    for i in range(peers):
        loaded, metrics = evaluator.file(workdir / f"peer{i}" / "final.safetensors")
        losses.append(metrics["val_loss"])
        hashes.append(loaded.params_sha256())
    contributed = {
        (p.index, int(e["round"])) for p in all_procs for e in p.outer_steps() if e.get("fallback") is None
    }
    samples = sum(int(e["samples"]) for p in all_procs for e in p.outer_steps())
    possible = peers * cfg.outer.num_rounds
    return {
        "churn": churn,
        "final_val_loss": max(losses),
        "final_val_loss_per_peer": losses,
        "params_identical": len(set(hashes)) == 1,
        "kills": kills,
        "peer_rounds_possible": possible,
        "peer_rounds_contributed": len(contributed),
        "peer_rounds_lost": possible - len(contributed),
        "samples_total": samples,
        "wall_s": round(wall_s, 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args(argv)
    sets = [*args.sets, f"outer.num_rounds={args.rounds}"]
    cfg = load_config(args.config, overrides=parse_set(sets))

    logs = ROOT / "runs" / "bench-churn"  # the peers' logs stay here for a look after the run
    calm = run_swarm(cfg, args.config, sets, args.peers, logs / "calm", churn=False, seed=args.seed)
    print(f"calm:  {json.dumps({k: v for k, v in calm.items() if k != 'kills'})}", flush=True)
    churn = run_swarm(cfg, args.config, sets, args.peers, logs / "churn", churn=True, seed=args.seed)
    print(f"churn: {json.dumps(churn)}", flush=True)

    result = {
        "benchmark": "churn",
        "experiment": {
            "config": str(args.config.resolve().relative_to(ROOT)),
            "sets": sets,
            "peers": args.peers,
        },
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "calm": calm,
        "churn": churn,
        "val_loss_ratio": churn["final_val_loss"] / calm["final_val_loss"],
        "wall_ratio": churn["wall_s"] / calm["wall_s"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "churn.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        "| run | kills | val loss (worst peer) | identical params | peer-rounds lost | samples | wall |",
        "| --- | ---: | ---: | :---: | ---: | ---: | ---: |",
    ]
    for name, r in (("calm", calm), ("churn", churn)):
        rows.append(
            f"| {name} | {len(r['kills'])} | {r['final_val_loss']:.4f} | {'yes' if r['params_identical'] else 'NO'} "
            f"| {r['peer_rounds_lost']} of {r['peer_rounds_possible']} | {r['samples_total']:,} | {r['wall_s']:.0f} s |"
        )
    rows.append("")
    rows.append(
        f"Churn / calm: validation loss {result['val_loss_ratio']:.3f}x, wall time {result['wall_ratio']:.2f}x."
    )
    replace_block("churn", rows, DOC)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
