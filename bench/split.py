"""A swarm split with real peers: 4 peers, each in a network namespace of its own on one bridge, lose each
other for a while (every link of the bridge down), then see each other again. Does the swarm come back
together, how soon, and does it end with one model?

    python -m bench.split                  # rounds in turn and verifiable rounds, 4 peers, a 15 s cut

What a run reads from the peers' JSON log lines: each peer's outer steps (round, group size), when the cut
began and ended (by the clock of this process: each log line carries its time), the first round after the
cut that every peer averaged in a group of all 4, and the final params hash of each peer. The in-memory
tests (tests/test_rounds.py, tests/test_verification.py) check the same on a cut of rounds; this is the
cut of a real network under libp2p, with its timeouts and reconnections.

Needs root (network namespaces: bench/netns.py). Results: bench/results/split.json and a table in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.netns import ShapedNet, available
from bench.report import RESULTS, replace_block
from p2ptrain.localswarm import PeerProcess, run_swarm

ROOT = Path(__file__).resolve().parent.parent
PEERS = 4
SETTINGS = {
    "rounds_in_turn": [],
    "verifiable": ["verification.replicas=2"],
}
"""Every setting runs configs/tiny.yaml with the timers below, and these settings on top."""
TIMERS = [
    "inner.num_inner_steps=40",  # rounds of a second or two: the run goes on well past the cut
    "averaging.barrier_timeout_s=10",  # a cut spans several barrier timeouts
    "swarm.catch_up_timeout_s=5",
    "verification.reveal_timeout_s=10",
]


def cut(net: ShapedNet, down: bool) -> None:
    """Every peer's link to the bridge down (or up again): nobody reaches anybody."""
    for i in range(net.peers):
        state = "down" if down else "up"
        subprocess.run(["ip", "-n", net.hub, "link", "set", f"v{i}", state], check=True, capture_output=True)


def cutter(procs: list[PeerProcess], net: ShapedNet, at_round: int, seconds: float, times: dict) -> None:
    """Once every peer has stepped round ``at_round``, cut the links for ``seconds``."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        steps = [p.outer_steps() for p in procs] if len(procs) == net.peers else []
        if steps and all(any(s.get("round", -1) >= at_round for s in ps) for ps in steps):
            break
        time.sleep(0.2)
    else:
        return
    times["cut"] = time.time()
    cut(net, down=True)
    time.sleep(seconds)
    cut(net, down=False)
    times["healed"] = time.time()


def log_time(event: dict) -> float:
    """A JSON log line's time (ISO 8601, UTC) in seconds since the epoch."""
    stamp = event.get("timestamp", "")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else 0.0


def run(
    name: str, sets: list[str], rounds: int, at_round: int, seconds: float, workdir: Path, peers: int = PEERS
) -> dict:
    """One swarm of ``peers`` to its end, cut once every peer has stepped ``at_round``, for ``seconds``."""
    shutil.rmtree(workdir, ignore_errors=True)
    run_id = f"split-{name}-{int(time.time())}"
    times: dict[str, float] = {}
    with ShapedNet(peers, None) as net:
        base = ["join", "--config", str(ROOT / "configs" / "tiny.yaml"), "--log-format", "json"]
        base += ["--set", "swarm.nat_port_map=false", "--set", "swarm.use_auto_relay=false"]
        for item in [*TIMERS, *sets, f"run.run_id={run_id}", f"outer.num_rounds={rounds}"]:
            base += ["--set", item]
        base += ["--set", f"swarm.min_peers={peers}"]
        extra = {i: ["--host-maddrs", f"/ip4/{net.address(i)}/tcp/0"] for i in range(peers)}

        def started(procs: list[PeerProcess]) -> None:
            threading.Thread(target=cutter, args=(procs, net, at_round, seconds, times), daemon=True).start()

        procs, codes = run_swarm(
            base,
            workdir,
            peers,
            extra=extra,
            timeout_s=1800,
            started=started,
            prefix=net.prefix,
            maddr_prefix=f"/ip4/{net.address(0)}/",
        )
    steps = [p.outer_steps() for p in procs]
    finals = [
        next((e.get("params_hash") for e in p.events() if e.get("event") == "finished"), None) for p in procs
    ]
    groups = {
        r: [next((s["group_size"] for s in ps if s["round"] == r), 0) for ps in steps] for r in range(rounds)
    }
    healed_at = times.get("healed", float("inf"))
    # The first round each peer stepped after the links came back, and the first that all 4 averaged in.
    after = [min((s["round"] for s in ps if log_time(s) >= healed_at), default=None) for ps in steps]
    together = [r for r in range(rounds) if all(g == peers for g in groups[r])]
    first_together = min((r for r in together if r > at_round), default=None)
    return {
        "sets": sets,
        "exit_codes": codes,
        "cut_after_round": at_round,
        "cut_s": round(times["healed"] - times["cut"], 1) if "healed" in times else None,
        "rounds_alone": sum(1 for r in range(rounds) for g in groups[r] if g == 1),
        "first_round_stepped_after_the_cut": after,
        "first_round_all_together_after_the_cut": first_together,
        "rounds_all_together_after_the_cut": sum(1 for r in together if r > at_round),
        "rounds": rounds,
        "one_final_model": len(set(finals)) == 1 and None not in finals,
        "group_sizes": {str(r): g for r, g in groups.items()},
    }


def table(results: dict) -> list[str]:
    rows = [
        "| setting | cut | peers' first round after the cut | first round all 4 averaged together again "
        "| rounds all 4 together after the cut, of those left | steps alone (all peers) | one final model "
        "| exit codes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        left = r["rounds"] - r["cut_after_round"] - 1
        rows.append(
            f"| {name} | {r['cut_s']} s after round {r['cut_after_round']} "
            f"| {', '.join(str(x) for x in r['first_round_stepped_after_the_cut'])} "
            f"| {r['first_round_all_together_after_the_cut']} | {r['rounds_all_together_after_the_cut']} of {left} "
            f"| {r['rounds_alone']} | {'yes' if r['one_final_model'] else 'no'} "
            f"| {', '.join(str(c) for c in r['exit_codes'])} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--at-round", type=int, default=5, help="cut once every peer has stepped this round")
    ap.add_argument("--seconds", type=float, default=15.0, help="how long the links stay down")
    ap.add_argument("--only", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-split")
    args = ap.parse_args()
    if (why := available()) is not None:
        raise SystemExit(f"bench.split: {why}")
    results = {}
    for name in args.only:
        results[name] = run(
            name, SETTINGS[name], args.rounds, args.at_round, args.seconds, args.workdir / name
        )
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "group_sizes"}), flush=True)
    out = RESULTS / "split.json"
    out.write_text(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "peers": PEERS,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    replace_block("split", table(results))


if __name__ == "__main__":
    main()
