"""Heterogeneous devices: three real peers of the default experiment on 127.0.0.1, one of them confined to a
fraction of a CPU core (a cgroup v1 CPU quota, as a slow laptop beside two fast machines), trained three ways in
one go with everything else equal:

- **rounds by steps** (``inner.num_inner_steps``): every peer does 15 steps a round, so the swarm runs at the
  slow peer's pace and the fast ones wait for it;
- **rounds by steps, training on** (``inner.max_steps_while_waiting``): the same, but a fast peer done with
  its 15 steps trains on, up to ``TRAIN_ON`` steps more, while the slow one finishes;
- **rounds by time** (``inner.round_seconds``): each peer trains until the round's deadline and is weighted
  by the samples it processed.

Reported side by side, from the peers' own logs: per peer, the share of its time spent training
(utilization: inner-phase seconds over the time from its first inner phase to its last outer step), samples
per round, rounds it contributed to; the validation loss over wall time, and at the wall time both runs
reached (equal wall time).

    python -m bench.heterogeneous [--rounds 12] [--round-seconds 20] [--quota 0.25]

Needs root (it makes a cgroup under /sys/fs/cgroup/cpu). Writes bench/results/heterogeneous.json and the
heterogeneous table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from datetime import datetime
from pathlib import Path

import torch

from bench.report import RESULTS, replace_block
from p2ptrain.localswarm import LOOPBACK, run_swarm

ROOT = Path(__file__).resolve().parent.parent
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
PEERS = 3
TRAIN_ON = 45
"""inner.max_steps_while_waiting of the third run: the fast peers train at most 4 x 15 steps a round."""


def make_cgroup(quota: float) -> Path:
    path = CGROUP_ROOT / f"p2ptrain-slow-{os.getpid()}"
    path.mkdir()
    period = 100_000
    (path / "cpu.cfs_period_us").write_text(f"{period}\n")
    (path / "cpu.cfs_quota_us").write_text(f"{int(quota * period)}\n")
    return path


def remove_cgroup(path: Path) -> None:
    deadline = time.monotonic() + 30
    while (path / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.5)  # its processes are exiting
    path.rmdir()


def _ts(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def run(name: str, sets: list[str], cgroup: Path, workdir: Path) -> dict:
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh swarm: no checkpoint of an earlier run to resume
    base = ["join", "--config", str(ROOT / "configs" / "default.yaml"), "--host-maddrs", LOOPBACK]
    base += ["--log-format", "json"]
    for item in [
        *sets,
        f"run.run_id=heterogeneous-{name}-{int(time.time())}",
        "device.num_threads=1",
        "data.eval_by=all",  # the loss-over-time curve reads one peer's loss after every round
        f"swarm.min_peers={PEERS}",
        # Groups of the whole roster: matchmaking ends when everyone is in, in both runs alike.
        f"averaging.target_group_size={PEERS}",
    ]:
        base += ["--set", item]
    procs, codes = run_swarm(
        base, workdir, PEERS, hostile={PEERS - 1: ("bench.throttled", [str(cgroup)])}, timeout_s=3600
    )
    if any(codes):
        raise SystemExit(f"{name}: exit codes {codes}; logs in {workdir}")
    peers = []
    for p in procs:
        steps = p.outer_steps()
        first_start = _ts(steps[0]) - steps[0]["duration_s"]
        span = _ts(steps[-1]) - first_start
        inner = sum(s["inner_s"] for s in steps)
        peers.append(
            {
                "slow": p.index == PEERS - 1,
                "rounds": len(steps),
                "rounds_in_a_group_of_all": sum(s["group_size"] == PEERS for s in steps),
                "rounds_contributed": sum(s["samples"] > 0 and s.get("fallback") is None for s in steps),
                "samples_per_round": [s["samples"] for s in steps],
                "inner_s": round(inner, 1),
                "span_s": round(span, 1),
                "utilization": round(inner / span, 3),
            }
        )
    watch = procs[0].outer_steps()
    start = _ts(watch[0]) - watch[0]["duration_s"]
    curve = [(round(_ts(s) - start, 1), s["val_loss"]) for s in watch]
    return {
        "sets": sets,
        "peers": peers,
        "curve": curve,
        "final_val_loss": curve[-1][1],
        "wall_s": curve[-1][0],
    }


def loss_at(curve: list[tuple[float, float]], t: float) -> tuple[float, int]:
    """The validation loss of the last round done by ``t`` seconds, and how many rounds were done."""
    done = [loss for at, loss in curve if at <= t + 1e-9]
    return (done[-1], len(done)) if done else (float("nan"), 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--round-seconds", type=float, default=20.0)
    ap.add_argument("--quota", type=float, default=0.25, help="the slow peer's share of one CPU core")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-heterogeneous")
    args = ap.parse_args()
    cgroup = make_cgroup(args.quota)
    rounds = f"outer.num_rounds={args.rounds}"
    try:
        results = {
            "by_steps": run("steps", [rounds], cgroup, args.workdir / "by-steps"),
            "by_steps_train_on": run(
                "steps-train-on",
                [rounds, f"inner.max_steps_while_waiting={TRAIN_ON}"],
                cgroup,
                args.workdir / "by-steps-train-on",
            ),
            "by_time": run(
                "time",
                [rounds, f"inner.round_seconds={args.round_seconds}", "inner.num_inner_steps=10000"],
                cgroup,
                args.workdir / "by-time",
            ),
        }
    finally:
        remove_cgroup(cgroup)
    equal = min(r["wall_s"] for r in results.values())
    for r in results.values():
        r["val_loss_at_equal_wall"], r["rounds_by_equal_wall"] = loss_at(r["curve"], equal)
    out = {
        "equal_wall_s": equal,
        "quota_of_a_core": args.quota,
        "round_seconds": args.round_seconds,
        "rounds": args.rounds,
        **results,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "heterogeneous.json").write_text(json.dumps(out, indent=2) + "\n")

    def row(label: str, r: dict) -> str:
        fast = [p for p in r["peers"] if not p["slow"]]
        (slow,) = [p for p in r["peers"] if p["slow"]]
        samples = slow["samples_per_round"]
        fast_utilization = ", ".join(f"{p['utilization']:.2f}" for p in fast)
        return (
            f"| {label} | {r['wall_s']:.0f} | {r['final_val_loss']:.3f} | {r['val_loss_at_equal_wall']:.3f} "
            f"({r['rounds_by_equal_wall']} rounds) | {fast_utilization} | "
            f"{slow['utilization']:.2f} | {min(samples)}–{max(samples)} | "
            f"{slow['rounds_contributed']} of {slow['rounds']} |"
        )

    replace_block(
        "heterogeneous",
        [
            "| rounds | wall s | final val loss | val loss at "
            f"{equal:.0f} s | utilization, fast peers | utilization, slow peer | slow peer's samples per "
            "round | rounds the slow peer contributed to |",
            "| --- | ---: | ---: | ---: | --- | ---: | --- | --- |",
            row("by steps (15 a round)", results["by_steps"]),
            row(f"by steps, training on while waiting (up to {TRAIN_ON} more)", results["by_steps_train_on"]),
            row(f"by time ({args.round_seconds:g} s a round)", results["by_time"]),
            "",
            f"3 peers of configs/default.yaml ({args.rounds} rounds, 1 thread each, groups of all 3), the third "
            f"confined to {args.quota:g} of a CPU core by a cgroup CPU quota; machine: {os.cpu_count()} CPUs. "
            "Utilization: inner-phase seconds over the time from a peer's first inner phase to its last outer "
            "step. Val loss: peer 0's model after the last round done by that wall time.",
        ],
    )
    print(
        json.dumps(
            {k: out[k] for k in ("equal_wall_s",)}
            | {
                k: {x: results[k][x] for x in ("final_val_loss", "val_loss_at_equal_wall", "wall_s")}
                for k in results
            }
        )
    )


if __name__ == "__main__":
    main()
