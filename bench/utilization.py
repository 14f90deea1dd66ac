"""Utilization: how much of a peer's life goes into training. Real peers of the default experiment (the demo's
swarm: 3 peers on 127.0.0.1, one CPU thread each), run side by side in one go under each setting below, and
from each peer's own log lines: the share of its time after start-up in each phase of a round —

- **inner**: the inner phase (training; utilization is this share),
- **barrier**: waiting for the round's other peers to finish theirs,
- **verify**: a verifiable round's reveal and verdict (0 here: verification is off by default),
- **sync**: matchmaking, all-reduce and outer step,
- **eval**: the validation loss (``data.eval_by``),
- **other**: the rest (reading and publishing records, checkpoints, logging),

and the final validation loss.

    python -m bench.utilization [--rounds 16] [--peers 3]

Then the default experiment again with 2, 3, 4 and 6 peers, in rounds by time (``inner.round_seconds``, so
that a round lasts as long at every size: on one machine, rounds by steps slow down as peers share its CPUs):
the non-payload traffic per peer per round (records, matchmaking, DHT) against the swarm's size.

Traffic is counted in the steady state: from the middle of a peer's second inner phase to the middle of its
last, when no all-reduce is in flight (a sample taken while one is would count part of its payload).

Writes bench/results/utilization.json and the utilization and traffic tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import threading
import time
from datetime import datetime
from pathlib import Path

import psutil
import torch
from hivemind.dht.routing import DHTID

from bench.netns import ShapedNet
from bench.report import RESULTS, replace_block
from p2ptrain.experiment import EXPERIMENTS_KEY
from p2ptrain.localswarm import LOOPBACK, run_swarm

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("inner", "barrier", "verify", "sync", "eval")

IN_TURN = "outer.overlap=false"
"""Rounds in turn: a round's barrier, all-reduce and outer step before the next round trains (the default
before 2026-12-04)."""

SETTINGS: dict[str, tuple[str, list[str]]] = {
    "default": (
        "the default: round r's all-reduce runs while round r+1 trains (outer.overlap), keeping half the progress "
        "trained before the average lands (outer.overlap_carry 0.5); one peer evaluates, in turn",
        [],
    ),
    "in_turn": (
        "rounds in turn, as the default before 2026-12-04 (outer.overlap=false): one peer evaluates, in turn, "
        "in the background",
        [IN_TURN],
    ),
    "every_peer_evaluates": (
        "in turn, every peer evaluating every round (data.eval_by=all)",
        [IN_TURN, "data.eval_by=all"],
    ),
    "tensor_by_tensor": (
        "in turn, sending the pseudo-gradient tensor by tensor as before 2026-12-03 (averaging.packed=false)",
        [IN_TURN, "averaging.packed=false"],
    ),
    "eval_inline": (
        "in turn, one peer evaluating, in turn, before it trains the next round "
        "(device.evaluate_in_background=false)",
        [IN_TURN, "device.evaluate_in_background=false"],
    ),
    "eval_every_4": (
        "in turn, evaluating after every 4th round only (data.eval_every=4)",
        [IN_TURN, "data.eval_every=4"],
    ),
    "overlap_carry_all": (
        "the default, keeping all the progress trained before the average lands, as before 2026-12-04 "
        "(outer.overlap_carry=1)",
        ["outer.overlap_carry=1.0"],
    ),
    "train_on": (
        "in turn, training on while the round's slower peers finish (inner.max_steps_while_waiting=15)",
        [IN_TURN, "inner.max_steps_while_waiting=15"],
    ),
    "train_on_eval_inline": (
        "in turn, training on, and evaluating before training the next round (device.evaluate_in_background=false)",
        [IN_TURN, "inner.max_steps_while_waiting=15", "device.evaluate_in_background=false"],
    ),
    "overlap_train_on": (
        "the default, training on while the slower peers finish (inner.max_steps_while_waiting=15)",
        ["inner.max_steps_while_waiting=15"],
    ),
    "overlap_train_on_carry_all": (
        "the default, training on, keeping all the progress trained before the average lands (outer.overlap_carry=1)",
        ["inner.max_steps_while_waiting=15", "outer.overlap_carry=1.0"],
    ),
}


WITHOUT_OVERLAP = {
    "default": "in_turn",
    "overlap_train_on": "train_on",
    "overlap_carry_all": "in_turn",
    "overlap_train_on_carry_all": "train_on",
}
"""Each overlapping setting and the one it differs from only by overlap (the quality table's ratio)."""

TRAFFIC_SETS = [IN_TURN, f"inner.round_seconds={4.0}", "inner.num_inner_steps=100000"]
"""The traffic-against-size runs: 4 s rounds by time."""


def _ts(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def phase_shares(steps: list[dict]) -> dict:
    """Per-phase seconds and shares of one peer's life, from its first inner phase to its last outer step."""
    span = _ts(steps[-1]) - (_ts(steps[0]) - steps[0]["duration_s"])
    seconds = {phase: sum(s.get(f"{phase}_s", 0.0) for s in steps) for phase in PHASES}
    seconds["other"] = span - sum(seconds.values())
    return {
        "span_s": round(span, 2),
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "shares": {k: round(v / span, 3) for k, v in seconds.items()},
        "utilization": round(seconds["inner"] / span, 3),
        "rounds": len(steps),
        "seconds_per_round": round(span / len(steps), 3),
        "samples": sum(s.get("samples", 0) for s in steps),
    }


class P2pdBytes:
    """The bytes each peer's ``p2pd`` read and wrote (``/proc/<pid>/io``), sampled every 0.1 s until the peers
    exit. Everything a peer sends or receives (records, matchmaking, the all-reduce) passes through its p2pd
    twice: once between the peer's processes and p2pd, once on the wire; half of p2pd's read and write bytes
    is the peer's traffic (libp2p's own framing and encryption aside). Linux only."""

    def __init__(self):
        self.last: dict[int, dict[int, int]] = {}  # peer index -> p2pd pid -> rchar + wchar
        self.pids: dict[int, set[int]] = {}  # peer index -> its processes' pids (for the wiretap's files)
        self.series: dict[int, list[tuple[float, int]]] = {}  # peer index -> (wall time, traffic so far)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, procs) -> None:
        self._thread = threading.Thread(target=self._loop, args=(procs,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self, procs) -> None:
        while not self._stop.wait(0.1):
            for p in list(procs):
                try:
                    children = psutil.Process(p.proc.pid).children(recursive=True)
                except psutil.Error:
                    continue
                self.pids.setdefault(p.index, set()).update([p.proc.pid, *(c.pid for c in children)])
                for child in children:
                    try:
                        if child.name() == "p2pd":
                            io = child.io_counters()
                            self.last.setdefault(p.index, {})[child.pid] = io.read_chars + io.write_chars
                    except psutil.Error:
                        pass
                if p.index in self.last:
                    self.series.setdefault(p.index, []).append((time.time(), self.traffic(p.index)))

    def traffic(self, index: int) -> int:
        """Bytes sent plus received by peer ``index`` (half its p2pd's read and write bytes)."""
        return sum(self.last.get(index, {}).values()) // 2

    def at(self, index: int, when: float) -> float:
        """Peer ``index``'s traffic so far at wall time ``when`` (between two samples: interpolated)."""
        series = self.series.get(index, [])
        before = [(t, b) for t, b in series if t <= when]
        after = [(t, b) for t, b in series if t > when]
        if not before or not after:
            raise SystemExit(f"peer {index}: no traffic samples around {when}")
        (t0, b0), (t1, b1) = before[-1], after[0]
        return b0 + (b1 - b0) * (when - t0) / (t1 - t0)


WIRETAP = ROOT / "bench" / "wiretap"
"""The folder whose sitecustomize taps what a peer's processes say to p2pd, by protocol (``P2PTRAIN_WIRETAP``)."""


def tapped(folder: Path, pids: set[int], t0: float, t1: float) -> dict[str, dict[str, int]]:
    """By libp2p protocol, the bytes (out + in) and calls a peer's processes (``pids``) made between wall times
    ``t0`` and ``t1``, from the wiretap's files in ``folder``."""
    totals: dict[str, dict[str, int]] = {}
    for pid in pids:
        path = folder / f"{pid}.jsonl"
        if not path.exists():
            continue
        snapshots = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

        def at(when: float, snapshots=snapshots) -> dict:
            before = [s["c"] for s in snapshots if s["t"] <= when]
            return before[-1] if before else {}

        c0, c1 = at(t0), at(t1)
        for proto, (out, into, calls) in c1.items():
            o0, i0, n0 = c0.get(proto, (0, 0, 0))
            total = totals.setdefault(proto, {"bytes": 0, "calls": 0})
            total["bytes"] += out + into - o0 - i0
            total["calls"] += calls - n0
    return totals


def protocol_label(proto: str, run_id: str) -> str:
    """A wiretap protocol in words: the run's prefix dropped, a DHT call's key named, the serving side merged
    with the calling one (a peer does both; what it costs is the sum)."""
    label = proto.removesuffix(" (served)").split("::")[-1]
    keys = {f"{run_id}_progress": "progress records", EXPERIMENTS_KEY: "experiment"}
    keys[f"{run_id}_diloco.all_averagers"] = "donor declarations"
    for key, name in keys.items():
        label = label.replace(DHTID.generate(source=key).to_bytes().hex()[:8], name)
    return label


def inner_midpoint(step: dict) -> float:
    """When the middle of the inner phase of the round an outer step line ends: its all-reduce is not in flight
    (its line is written after the evaluation that follows the round)."""
    started = _ts(step) - step.get("eval_s", 0.0) - step["duration_s"]
    return started + step["inner_s"] / 2


def steady_traffic(sampler: P2pdBytes, index: int, steps: list[dict], tap: Path | None = None) -> dict:
    """Non-payload and payload bytes per round and per second of one peer, from the middle of its second inner
    phase to the middle of its last (start-up and goodbye left out); with the wiretap's folder ``tap``, what
    its processes handed p2pd in that time by protocol, per round."""
    first, last = 1, len(steps) - 1
    t0, t1 = inner_midpoint(steps[first]), inner_midpoint(steps[last])
    total = sampler.at(index, t1) - sampler.at(index, t0)
    payload = sum(s["bytes_sent"] + s["bytes_received"] for s in steps[first:last])  # the syncs in between
    rounds = last - first
    out = {
        "rounds": rounds,
        "non_payload_bytes_per_round": round((total - payload) / rounds),
        "payload_bytes_per_round": round(payload / rounds),
        "non_payload_bytes_per_s": round((total - payload) / (t1 - t0)),
    }
    if tap is not None:
        by_protocol = tapped(tap, sampler.pids.get(index, set()), t0, t1)
        out["by_protocol_per_round"] = {
            proto: {k: round(v / rounds, 1) for k, v in counts.items()}
            for proto, counts in sorted(by_protocol.items())
            if counts["calls"] or counts["bytes"]
        }
    return out


def run(
    name: str,
    sets: list[str],
    peers: int,
    rounds: int,
    workdir: Path,
    *,
    overlapped: bool = False,
    net: ShapedNet | None = None,
    tap: bool = False,
) -> dict:
    """The swarm of ``peers`` peers under ``sets``, to its end: each peer's phase shares and traffic. ``net``:
    each peer in its namespace of a shaped network (else on 127.0.0.1). ``tap``: with the wiretap (traffic by
    protocol)."""
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh swarm: no checkpoint of an earlier run to resume
    run_id = f"utilization-{name}-{int(time.time())}"
    base = ["join", "--config", str(ROOT / "configs" / "default.yaml"), "--log-format", "json"]
    if net is None:
        base += ["--host-maddrs", LOOPBACK]
        extra: dict[int, list[str]] = {}
    else:  # nothing to map or probe on a bridge of our own: no UPnP, no relays
        base += ["--set", "swarm.nat_port_map=false", "--set", "swarm.use_auto_relay=false"]
        extra = {i: ["--host-maddrs", f"/ip4/{net.address(i)}/tcp/0"] for i in range(peers)}
    for item in [
        *sets,
        f"run.run_id={run_id}",
        f"outer.num_rounds={rounds}",
        "device.num_threads=1",  # as the demo on 2 cores
        f"swarm.min_peers={peers}",
    ]:
        base += ["--set", item]
    sampler = P2pdBytes()
    tap_folder = workdir / "wiretap" if tap else None
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "P2PTRAIN_WIRETAP")}
    if tap_folder is not None:  # the peers inherit our environment
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WIRETAP), saved["PYTHONPATH"]]))
        os.environ["P2PTRAIN_WIRETAP"] = str(tap_folder)
    try:
        procs, codes = _run_swarm_sampled(base, workdir, peers, extra, sampler, net)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if any(codes):
        raise SystemExit(f"{name}: exit codes {codes}; logs in {workdir}")
    per_peer = [phase_shares(p.outer_steps()) for p in procs]
    traffic = None
    if not overlapped:  # with overlap an all-reduce is always in flight: no quiet moment to count from
        for p, shares in zip(procs, per_peer):
            shares["traffic"] = steady_traffic(sampler, p.index, p.outer_steps(), tap_folder)
        traffic = {
            key: round(sum(p["traffic"][key] for p in per_peer) / len(per_peer))
            for key in ("non_payload_bytes_per_round", "payload_bytes_per_round", "non_payload_bytes_per_s")
        }
        if tap_folder is not None:  # mean over the peers, by protocol in words
            merged: dict[str, dict[str, float]] = {}
            for p in per_peer:
                for proto, counts in p["traffic"]["by_protocol_per_round"].items():
                    total = merged.setdefault(protocol_label(proto, run_id), {"bytes": 0.0, "calls": 0.0})
                    for k in total:
                        total[k] += counts[k] / len(per_peer)
            traffic["by_protocol_per_round"] = {
                label: {k: round(v, 1) for k, v in counts.items()} for label, counts in sorted(merged.items())
            }
    finals = [s["val_loss"] for p in procs for s in p.outer_steps()[-1:] if s.get("val_loss") is not None]
    mean = {k: round(sum(p["shares"][k] for p in per_peer) / len(per_peer), 3) for k in (*PHASES, "other")}
    return {
        "sets": sets,
        "traffic": traffic,
        "peers": per_peer,
        "mean_shares": mean,
        "utilization": [p["utilization"] for p in per_peer],
        "final_val_loss": max(finals),
    }


def _run_swarm_sampled(base, workdir, peers, extra, sampler, net):
    try:
        return run_swarm(
            base,
            workdir,
            peers,
            extra=extra,
            timeout_s=1800,
            started=sampler.start,
            prefix=net.prefix if net is not None else None,
            maddr_prefix=f"/ip4/{net.address(0)}/" if net is not None else "/ip4/127.0.0.1/",
        )
    finally:
        sampler.stop()


def seed_summary(r: dict) -> dict:
    """What the quality table needs of one run: its final val loss, samples, pace and utilization."""
    peers = r["peers"]
    return {
        "final_val_loss": r["final_val_loss"],
        "samples": sum(p["samples"] for p in peers),
        "seconds_per_round": round(sum(p["seconds_per_round"] for p in peers) / len(peers), 2),
        "utilization": round(sum(r["utilization"]) / len(r["utilization"]), 3),
    }


def quality_rows(by_seed: dict[str, dict[str, dict]]) -> list[str]:
    """Final val loss by seed, each overlapping setting against the same setting without overlap, seed by
    seed (one seed moves this short run's final loss by several percent: only ratios over seeds tell)."""
    rows = [
        "| setting | seeds | final val loss by seed | mean | vs the same without overlap, seed by seed (mean) "
        "| vs the default, seed by seed (mean) | samples trained, all peers (mean) | s per round (mean) "
        "| utilization (mean) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731

    def ratio(name: str, base: str | None) -> str:
        if base is None or base not in by_seed:
            return "—"
        common = sorted(set(by_seed[name]) & set(by_seed[base]), key=int)
        if not common:
            return "—"
        rs = [by_seed[name][s]["final_val_loss"] / by_seed[base][s]["final_val_loss"] for s in common]
        return f"{', '.join(f'{x - 1:+.1%}' for x in rs)} ({mean(rs) - 1:+.1%})"

    for name, runs in by_seed.items():
        order = sorted(runs, key=int)
        losses = [runs[s]["final_val_loss"] for s in order]
        rows.append(
            f"| {name} | {', '.join(order)} | {', '.join(f'{x:.4f}' for x in losses)} | {mean(losses):.4f} "
            f"| {ratio(name, WITHOUT_OVERLAP.get(name))} | {ratio(name, 'default' if name != 'default' else None)} "
            f"| {mean([runs[s]['samples'] for s in order]):,.0f} "
            f"| {mean([runs[s]['seconds_per_round'] for s in order]):.2f} "
            f"| {mean([runs[s]['utilization'] for s in order]):.2f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--traffic-peers", type=int, nargs="*", default=[2, 3, 4, 6])
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-utilization")
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="run.seed of each setting's runs; the phase table shows seed 0's, the quality table every seed's",
    )
    args = ap.parse_args()
    results = {}
    by_seed: dict[str, dict[str, dict]] = {}
    for name in args.only:
        label, sets = SETTINGS[name]
        overlapped = IN_TURN not in sets
        for seed in args.seeds:
            print(f"{name}, seed {seed}: {label}", flush=True)
            r = run(
                f"{name}-seed{seed}",
                [*sets, f"run.seed={seed}"],
                args.peers,
                args.rounds,
                args.workdir / f"{name}-seed{seed}",
                overlapped=overlapped,
            )
            by_seed.setdefault(name, {})[str(seed)] = seed_summary(r)
            if seed == 0:
                results[name] = r
            print(f"  utilization {r['utilization']}, shares {r['mean_shares']}", flush=True)
    # Traffic against swarm size, in rounds by time: every size's rounds last as long (by steps, N peers on one
    # machine's CPUs train N times slower, and what a peer sends each second would count N times per round).
    traffic = {}
    for n in args.traffic_peers:
        print(f"traffic: {n} peers", flush=True)
        r = run(f"traffic-{n}", TRAFFIC_SETS, n, args.rounds, args.workdir / f"traffic-{n}", tap=True)
        traffic[n] = {
            **r["traffic"],
            "seconds_per_round": round(sum(p["seconds_per_round"] for p in r["peers"]) / len(r["peers"]), 2),
        }
    # A partial run (--only, --traffic-peers) keeps the earlier results of what it did not run.
    earlier = (
        json.loads((RESULTS / "utilization.json").read_text())
        if (RESULTS / "utilization.json").exists()
        else {}
    )
    results = {k: results.get(k) or earlier.get("results", {}).get(k) for k in SETTINGS}
    results = {k: v for k, v in results.items() if v is not None}
    seeds = earlier.get("by_seed", {})
    for name, runs in by_seed.items():
        seeds.setdefault(name, {}).update(runs)
    for name, r in results.items():  # seed 0's runs of a results file from before seeds were kept
        if all("samples" in p for p in r["peers"]):
            seeds.setdefault(name, {}).setdefault("0", seed_summary(r))
    by_seed = {k: seeds[k] for k in SETTINGS if k in seeds}
    if not traffic:
        traffic = {int(n): t for n, t in earlier.get("traffic_by_peers", {}).items()}
    out = {
        "machine": {"cpu_count": torch.get_num_threads(), "platform": platform.platform()},
        "experiment": {"config": "configs/default.yaml", "peers": args.peers, "rounds": args.rounds},
        "traffic_sets": TRAFFIC_SETS,
        "results": results,
        "by_seed": by_seed,
        "traffic_by_peers": traffic,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "utilization.json").write_text(json.dumps(out, indent=2) + "\n")
    rows = [
        "| setting | utilization per peer | inner | barrier | sync | eval | other | s per round "
        "| non-payload kB per peer per round | samples trained, all peers | final val loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        m = r["mean_shares"]
        per_round = sum(p["seconds_per_round"] for p in r["peers"]) / len(r["peers"])
        # With overlap the phases run beside training: their shares overlap the inner phase's, no "other".
        other = f"{max(m['other'], 0.0):.2f}" if m["other"] > -0.01 else "—"
        traffic_kb = f"{r['traffic']['non_payload_bytes_per_round'] / 1e3:.0f}" if r["traffic"] else "—"
        counted = all("samples" in p for p in r["peers"])  # results from before it was counted: —
        samples = f"{sum(p['samples'] for p in r['peers']):,}" if counted else "—"
        rows.append(
            f"| {SETTINGS[name][0]} | {', '.join(f'{u:.2f}' for u in r['utilization'])} | {m['inner']:.2f} | "
            f"{m['barrier']:.2f} | {m['sync']:.2f} | {m['eval']:.2f} | {other} | {per_round:.2f} | "
            f"{traffic_kb} | {samples} | {r['final_val_loss']:.4f} |"
        )
    replace_block("utilization", rows)
    print("\n".join(rows))
    rows = quality_rows(by_seed)
    replace_block("utilization-seeds", rows)
    print("\n".join(rows))
    smallest = traffic[min(traffic)]["non_payload_bytes_per_round"] if traffic else 1
    rows = [
        "| peers | non-payload kB per peer per round | vs the smallest swarm | non-payload kB per peer per s "
        "| payload kB per peer per round | s per round |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, t in traffic.items():
        rows.append(
            f"| {n} | {t['non_payload_bytes_per_round'] / 1e3:.1f} | "
            f"{t['non_payload_bytes_per_round'] / smallest:.2f} | {t['non_payload_bytes_per_s'] / 1e3:.2f} | "
            f"{t['payload_bytes_per_round'] / 1e3:.0f} | {t['seconds_per_round']:.2f} |"
        )
    replace_block("traffic", rows)
    print("\n".join(rows))
    rows = traffic_by_protocol(traffic)
    replace_block("traffic-protocols", rows)
    print("\n".join(rows))


ALLREDUCE = "ExactAverager.rpc_aggregate_part"


def traffic_by_protocol(traffic: dict) -> list[str]:
    """The non-payload traffic per peer per round of each swarm size, by what it is: each protocol's bytes as
    the peer's processes handed them to p2pd (calls and served calls together), the all-reduce's framing
    beyond its tensors, and what libp2p and p2pd add on the way (the rest of p2pd's count)."""
    sizes = [n for n, t in traffic.items() if "by_protocol_per_round" in t]
    if not sizes:
        return []
    labels = sorted({k for n in sizes for k in traffic[n]["by_protocol_per_round"]} - {ALLREDUCE})
    rows = [
        "| kB per peer per round (calls) | " + " | ".join(f"{n} peers" for n in sizes) + " |",
        "| --- |" + " --- |" * len(sizes),
    ]
    cells: dict[str, list[str]] = {label: [] for label in labels}
    framing, libp2p = [], []
    for n in sizes:
        t = traffic[n]
        protos = t["by_protocol_per_round"]
        for label in labels:
            c = protos.get(label, {"bytes": 0.0, "calls": 0.0})
            cells[label].append(f"{c['bytes'] / 1e3:.1f} ({c['calls']:.1f})")
        allreduce = protos.get(ALLREDUCE, {"bytes": 0.0, "calls": 0.0})
        frame = allreduce["bytes"] - t["payload_bytes_per_round"]
        framing.append(f"{frame / 1e3:.1f} ({allreduce['calls']:.1f})")
        handed = sum(c["bytes"] for k, c in protos.items() if k != ALLREDUCE) + frame
        libp2p.append(f"{(t['non_payload_bytes_per_round'] - handed) / 1e3:.1f}")
    for label in labels:
        rows.append(f"| {label} | " + " | ".join(cells[label]) + " |")
    rows.append("| all-reduce streams: framing beyond the tensors | " + " | ".join(framing) + " |")
    rows.append("| libp2p and p2pd on the way (the rest of p2pd's count) | " + " | ".join(libp2p) + " |")
    total = [f"**{traffic[n]['non_payload_bytes_per_round'] / 1e3:.1f}**" for n in sizes]
    rows.append("| **non-payload, all of it** | " + " | ".join(total) + " |")
    return rows


if __name__ == "__main__":
    main()
