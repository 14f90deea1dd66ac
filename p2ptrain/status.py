"""``p2ptrain status``: the swarm as its DHT records show it, for people (a table) and scripts (JSON)."""

from __future__ import annotations

import time
from typing import Any

from p2ptrain.records import PeerState, ProgressRecord, global_round


def summarize(run_id: str, records: dict[str, ProgressRecord], now: float | None = None) -> dict[str, Any]:
    """The swarm's state from its live records: one entry per peer, the global round, total throughput."""
    now = time.time() if now is None else now
    peers = [
        {
            "peer_id": r.peer_id,
            "short_id": r.peer_id[-8:],
            "state": r.state.value,
            "device": r.device,
            "round": r.round,
            "samples_per_s": round(r.samples_per_s, 2),
            "samples_total": r.samples_total,
            "benchmark_samples_per_s": round(r.benchmark_samples_per_s, 1),
            "benchmark_gflops": round(r.benchmark_flops / 1e9, 2),
            "compute_s": round(r.compute_s, 1),
            "rounds_contributed": r.rounds_contributed,
            "last_group_size": r.last_group_size,
            "last_seen_s": round(max(0.0, now - r.time), 1),
            "sees_peers": r.seen,
        }
        for r in sorted(records.values(), key=lambda r: (-r.round, r.peer_id))
    ]
    # Verifiable runs: what the peers' records say of each other (each lists its view of the reputation).
    reporters = [r for r in records.values() if r.shard or r.trusted or r.struck or r.banned]
    if reporters:
        for entry in peers:
            short = entry["short_id"]
            own = records[entry["peer_id"]]
            strikes = [
                int(n)
                for r in reporters
                for item in r.struck
                for sid, _, n in [item.partition(":")]
                if sid == short and n.isascii() and n.isdigit()
            ]
            entry["verification"] = {
                "shard": own.shard,
                "replicas": [p[-8:] for p in own.replicas],
                "trusted_by": sum(short in r.trusted for r in reporters),
                "strikes": max(strikes, default=0),
                "banned_by": sum(short in r.banned for r in reporters),
                "reporters": len(reporters),
            }
    training = [r for r in records.values() if r.state in (PeerState.TRAINING, PeerState.AVERAGING)]
    return {
        "run_id": run_id,
        "round": global_round(records),
        "verifiable": bool(reporters),
        "peers": peers,
        "samples_per_s": round(sum(r.samples_per_s for r in training), 2),
        "samples_total": sum(r.samples_total for r in records.values()),
        "compute_s": round(sum(r.compute_s for r in records.values()), 1),
    }


def render(summary: dict[str, Any]) -> str:
    """A plain-text table (rich formats it when on a terminal)."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    at = f"round {summary['round']}" if summary["round"] >= 0 else "no round yet"
    head = (
        f"run {summary['run_id']}: {len(summary['peers'])} live peer(s), {at}, "
        f"{summary['samples_per_s']:.1f} samples/s in total, {summary['samples_total']:,} samples and "
        f"{_duration(summary.get('compute_s', 0.0))} of compute so far"
    )
    if not summary["peers"]:
        return head
    table = Table(box=None, pad_edge=False)
    columns = [
        "peer",
        "state",
        "device",
        "speed",
        "round",
        "samples/s",
        "samples",
        "compute",
        "rounds",
        "group",
    ]
    columns += ["last seen"]
    if summary.get("verifiable"):
        columns += ["shard", "trusted by", "strikes", "banned by"]
    for column in columns:
        table.add_column(
            column, justify="right" if column not in ("peer", "state", "device", "shard") else "left"
        )
    for p in summary["peers"]:
        row = [
            p["short_id"],
            p["state"],
            p["device"],
            _speed(p),
            str(p["round"]),
            f"{p['samples_per_s']:.1f}",
            f"{p['samples_total']:,}",
            _duration(p["compute_s"]),
            str(p["rounds_contributed"]),
            str(p["last_group_size"]),
            f"{p['last_seen_s']:.1f} s ago",
        ]
        if summary.get("verifiable"):
            v = p.get("verification", {})
            row += [
                v.get("shard") or "-",
                f"{v.get('trusted_by', 0)}/{v.get('reporters', 0)}",
                str(v.get("strikes", 0)),
                f"{v.get('banned_by', 0)}/{v.get('reporters', 0)}",
            ]
        table.add_row(*(_cell(value) for value in row))
    out = StringIO()
    Console(file=out, width=200, color_system=None).print(table)
    return head + "\n" + out.getvalue().rstrip()


def _cell(value: str) -> Any:
    """A table cell as plain text: a record's strings come from other peers, and neither rich's markup in them
    ('[/bold]' raised an error) nor a terminal's escape sequences may act on the reader's terminal."""
    from rich.text import Text

    return Text("".join(c if c.isprintable() else "?" for c in value))


def _speed(peer: dict[str, Any]) -> str:
    """Its device benchmark: samples/s at the run's model, and GFLOP/s."""
    if not peer.get("benchmark_samples_per_s"):
        return "-"
    return f"{peer['benchmark_samples_per_s']:.0f}/s, {peer['benchmark_gflops']:.1f} GFLOP/s"


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
