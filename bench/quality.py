"""Three-way quality benchmark on the default experiment, in one run, at equal samples per peer:

  single  one peer alone (same number of steps as each peer below)
  ddp     synchronous data-parallel with N processes (torch DDP over gloo on 127.0.0.1)
  diloco  p2ptrain with N peers (real hivemind swarm on 127.0.0.1, the `p2ptrain demo` machinery)

Bytes are measured, not computed: the loopback interface's transmitted bytes during each run
(/proc/net/dev, headers included) divided by N. For DiLoCo that includes the DHT's records and
matchmaking too; the all-reduce payload alone (counted by p2ptrain's runner) is reported beside it.

    python -m bench.quality [--peers 3] [--config configs/default.yaml] [--set key=value ...]

Writes bench/results/quality.json and the quality table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.report import DOC, replace_block
from p2ptrain.config import load_config, parse_set
from p2ptrain.demo import run_demo

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def loopback_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_sgd(world: int, threads: int, config: Path | None, sets: list[str], tmp: Path) -> dict:
    port = free_port()
    tx0, t0 = loopback_tx_bytes(), time.monotonic()
    procs = []
    for rank in range(world):
        cmd = [
            sys.executable,
            "-m",
            "bench.sgd_worker",
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--out",
            str(tmp / f"sgd{world}-{rank}.json"),
        ]
        if config:
            cmd += ["--config", str(config)]
        for s in sets:
            cmd += ["--set", s]
        procs.append(subprocess.Popen(cmd, cwd=ROOT))
    for p in procs:
        if p.wait(3600) != 0:
            raise RuntimeError(f"baseline worker exited with {p.returncode}")
    wall = time.monotonic() - t0
    tx = loopback_tx_bytes() - tx0
    result = json.loads((tmp / f"sgd{world}-0.json").read_text())
    return {
        "val_loss": result["val_loss"],
        "perplexity": result["perplexity"],
        "samples_per_peer": result["samples_per_rank"],
        "wall_s": round(wall, 1),
        "bytes_sent_per_peer": tx // world if world > 1 else 0,
        "params": result["params"],
    }


def run_diloco(peers: int, config: Path | None, sets: list[str], tmp: Path) -> dict:
    cfg = load_config(config, parse_set(sets))
    tx0 = loopback_tx_bytes()
    summary = run_demo(cfg, peers=peers, workdir=tmp / "diloco", config_path=config, sets=sets)
    tx = loopback_tx_bytes() - tx0
    if not summary["params_identical"]:
        raise RuntimeError("DiLoCo peers ended with different params")
    return {
        "val_loss": summary["final_val_loss"],
        "samples_per_peer": summary["samples_total"] // peers,
        "wall_s": summary["wall_s"],
        "bytes_sent_per_peer": tx // peers,
        "allreduce_payload_bytes_per_peer": sum(summary["bytes_sent_per_peer"]) // peers,
        "rounds": summary["rounds"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    ap.add_argument("--block", default="quality", help="the table in docs/benchmarks.md to write")
    args = ap.parse_args()
    cfg = load_config(args.config, parse_set(args.sets))
    cores = os.cpu_count() or 1
    n = args.peers

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        print(f"[1/3] single peer ({cores} threads)", flush=True)
        single = run_sgd(1, cores, args.config, args.sets, tmp)
        print(f"      val loss {single['val_loss']:.4f} in {single['wall_s']}s", flush=True)
        print(f"[2/3] DDP, {n} processes over gloo", flush=True)
        ddp = run_sgd(n, max(1, cores // n), args.config, args.sets, tmp)
        print(f"      val loss {ddp['val_loss']:.4f} in {ddp['wall_s']}s", flush=True)
        print(f"[3/3] p2ptrain DiLoCo, {n} peers", flush=True)
        diloco = run_diloco(n, args.config, args.sets, tmp)

    H = cfg.inner.num_inner_steps
    result = {
        "experiment": {
            "config": str(args.config or "configs/default.yaml"),
            "overrides": args.sets,
            "model": cfg.model.name,
            "params": single["params"],
            "peers": n,
            "rounds": cfg.outer.num_rounds,
            "inner_steps_per_round": H,
            "batch_size": cfg.inner.batch_size,
            "samples_per_peer": single["samples_per_peer"],
            "compression": cfg.averaging.compression,
        },
        "machine": {"cpus": cores, "python": platform.python_version(), "torch": torch.__version__},
        "single": single,
        "ddp": ddp,
        "diloco": diloco,
        "ratios": {
            "diloco_val_loss_over_ddp": diloco["val_loss"] / ddp["val_loss"],
            "ddp_bytes_over_diloco_bytes": ddp["bytes_sent_per_peer"] / max(diloco["bytes_sent_per_peer"], 1),
            "ddp_bytes_over_diloco_payload": ddp["bytes_sent_per_peer"]
            / max(diloco["allreduce_payload_bytes_per_peer"], 1),
            "diloco_wall_over_ddp_wall": diloco["wall_s"] / ddp["wall_s"],
        },
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    write_table(result, args.block)
    print(json.dumps(result["ratios"], indent=2))
    print(f"wrote {args.out} and the quality table in {DOC.relative_to(ROOT)}")


def write_table(r: dict, block: str = "quality") -> None:
    e, mb, ratios = r["experiment"], 1e6, r["ratios"]
    rows = [
        "| run | val loss | bytes sent per peer | wall |",
        "| --- | ---: | ---: | ---: |",
        f"| one peer alone | {r['single']['val_loss']:.4f} | 0 | {r['single']['wall_s']:.0f} s |",
        f"| DDP, {e['peers']} processes (gloo) | {r['ddp']['val_loss']:.4f} | "
        f"{r['ddp']['bytes_sent_per_peer'] / mb:.1f} MB | {r['ddp']['wall_s']:.0f} s |",
        f"| p2ptrain DiLoCo, {e['peers']} peers | {r['diloco']['val_loss']:.4f} | "
        f"{r['diloco']['bytes_sent_per_peer'] / mb:.1f} MB "
        f"({r['diloco']['allreduce_payload_bytes_per_peer'] / mb:.1f} MB all-reduce payload) | "
        f"{r['diloco']['wall_s']:.0f} s |",
        "",
        f"DiLoCo / DDP validation loss: **{ratios['diloco_val_loss_over_ddp']:.3f}**. "
        f"DDP / DiLoCo bytes: **{ratios['ddp_bytes_over_diloco_bytes']:.1f}x** on the wire, "
        f"{ratios['ddp_bytes_over_diloco_payload']:.1f}x counting the all-reduce payload alone "
        f"(H = {e['inner_steps_per_round']}). DiLoCo / DDP wall time: {ratios['diloco_wall_over_ddp_wall']:.2f}.",
        "",
        f"Setup: {e['model']} ({e['params']:,} params), {e['peers']} peers, {e['rounds']} rounds x "
        f"{e['inner_steps_per_round']} inner steps x batch {e['batch_size']} = {e['samples_per_peer']:,} samples per "
        f"peer, compression `{e['compression']}`, config `{e['config']}` {' '.join(e['overrides'])}; "
        f"{r['machine']['cpus']} CPUs, torch {r['machine']['torch']}, {r['date']}.",
    ]
    replace_block(block, rows)


if __name__ == "__main__":
    main()
