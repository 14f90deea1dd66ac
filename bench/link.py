"""The all-reduce on a shaped link: how close it comes to the link's rate, and how much of a peer's life is
training when the link is a real one's.

1. Transfers: two processes, each in its own network namespace on a bridge (``bench/netns.py``), every link
   held to 100 and to 20 Mbit/s each way by a token bucket, and on loopback; on each link, in one go, the
   same bytes each way three times: a plain TCP socket (the link's rate), p2ptrain's all-reduce of a float32
   tensor of that size (``averaging.SwarmAverager``, no compression: N bytes each way), and torch gloo's
   all-reduce of it (what a datacenter user's DDP would run). ``bench/link_worker.py`` is each side.
2. Utilization: the demo's swarm (3 peers of ``configs/default.yaml``) with each peer in its namespace on
   the 100 Mbit/s link: the default (``outer.overlap``), rounds in turn, in turn evaluating in the training
   thread, and in turn training on (``bench.utilization``'s settings ``default``, ``in_turn``,
   ``eval_inline``, ``train_on``), read as ``bench.utilization`` reads it.

    python -m bench.link [--bytes 16000000] [--repeats 3] [--rates 100 20] [--rounds 16]

Needs root, ``ip`` and ``tc``. Writes bench/results/link.json and the link tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.netns import ShapedNet, available
from bench.report import RESULTS, replace_block
from bench.utilization import IN_TURN, SETTINGS
from bench.utilization import run as run_swarm_bench

ROOT = Path(__file__).resolve().parent.parent
MODES = ("tcp", "hivemind", "gloo")


def transfer(mode: str, net: ShapedNet | None, nbytes: int, repeats: int) -> dict:
    """Seconds per transfer of ``nbytes`` each way between two processes (the slower side's median)."""
    hosts = [net.address(i) for i in range(2)] if net is not None else ["127.0.0.1", "127.0.0.1"]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in (0, 1):
            cmd = [*(net.prefix(rank) if net is not None else []), sys.executable, "-m", "bench.link_worker"]
            cmd += [mode, "--rank", str(rank), "--host", hosts[rank], "--peer", hosts[1 - rank]]
            cmd += ["--bytes", str(nbytes), "--repeats", str(repeats), "--maddr-file", f"{tmp}/maddr"]
            cmd += ["--ifname", "eth0" if net is not None else "lo"]
            out, err = open(f"{tmp}/{rank}.out", "w+"), open(f"{tmp}/{rank}.err", "w+")
            procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True), out, err))
        deadline = time.monotonic() + 600
        try:
            while any(p.poll() is None for p, _, _ in procs):  # a side that fails ends the other at once
                failed = [p for p, _, _ in procs if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    why = f"a side exited with {failed[0].returncode}" if failed else "no end within 600 s"
                    errors = "".join(open(f"{tmp}/{r}.err").read()[-1500:] for r in (0, 1))
                    raise SystemExit(f"{mode} between {hosts}: {why}: {errors}")
                time.sleep(0.1)
            outs = []
            for _, out, _ in procs:
                out.seek(0)
                outs.append(json.loads(out.read().strip().splitlines()[-1]))
        finally:
            for p, out, err in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                out.close()
                err.close()
    seconds = max(o["median_s"] for o in outs)
    return {"seconds": round(seconds, 4), "MB_per_s": round(nbytes / seconds / 1e6, 2), "runs": outs}


def transfers(rate: float | None, nbytes: int, repeats: int) -> dict:
    name = f"{rate:g} Mbit/s" if rate is not None else "loopback"
    results = {}
    if rate is None:
        for mode in MODES:
            results[mode] = transfer(mode, None, nbytes, repeats)
    else:
        with ShapedNet(2, rate) as net:
            for mode in MODES:
                results[mode] = transfer(mode, net, nbytes, repeats)
    print(name, {m: r["MB_per_s"] for m, r in results.items()}, flush=True)
    return {"link": name, "rate_mbit": rate, **results}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=16_000_000, help="bytes each way per transfer")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rates", type=float, nargs="*", default=[100.0, 20.0])
    ap.add_argument("--rounds", type=int, default=16, help="rounds of the utilization runs")
    ap.add_argument("--skip-utilization", action="store_true")
    args = ap.parse_args()
    if (why := available()) is not None:
        raise SystemExit(f"bench.link: {why}")
    # A stop (SIGTERM, a timeout's kill) unwinds: the namespaces are removed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    links = [transfers(None, args.bytes, args.repeats)] + [
        transfers(r, args.bytes, args.repeats) for r in args.rates
    ]
    utilization = {}
    if not args.skip_utilization:
        rate = args.rates[0]
        for name in ("default", "in_turn", "eval_inline", "train_on"):
            sets = SETTINGS[name][1]
            print(f"utilization on {rate:g} Mbit/s: {name}", flush=True)
            with ShapedNet(3, rate) as net:
                workdir = ROOT / "runs" / "bench-link" / name
                overlapped = IN_TURN not in sets
                r = run_swarm_bench(
                    f"link-{name}", sets, 3, args.rounds, workdir, overlapped=overlapped, net=net
                )
            utilization[name] = {"rate_mbit": rate, **r}
            print(f"  utilization {r['utilization']}", flush=True)
    out = {
        "machine": {"platform": platform.platform()},
        "bytes_each_way": args.bytes,
        "links": links,
        "utilization": utilization,
        "seconds": round(time.monotonic() - t0),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "link.json").write_text(json.dumps(out, indent=2) + "\n")
    rows = [
        "| link | plain TCP MB/s each way | p2ptrain all-reduce MB/s | vs TCP | torch gloo all-reduce MB/s | vs TCP |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for link in links:
        tcp, hm, gl = (link[m]["MB_per_s"] for m in MODES)
        rows.append(f"| {link['link']} | {tcp:.1f} | {hm:.1f} | {hm / tcp:.2f} | {gl:.1f} | {gl / tcp:.2f} |")
    replace_block("link", rows)
    print("\n".join(rows))
    if utilization:
        rows = [
            "| setting | utilization per peer | inner | barrier | sync | eval | s per round | final val loss |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in utilization.items():
            m = r["mean_shares"]
            per_round = sum(p["seconds_per_round"] for p in r["peers"]) / len(r["peers"])
            rows.append(
                f"| {name} ({r['rate_mbit']:g} Mbit/s) | {', '.join(f'{u:.2f}' for u in r['utilization'])} | "
                f"{m['inner']:.2f} | {m['barrier']:.2f} | {m['sync']:.2f} | {m['eval']:.2f} | {per_round:.2f} | "
                f"{r['final_val_loss']:.4f} |"
            )
        replace_block("link-utilization", rows)
        print("\n".join(rows))


if __name__ == "__main__":
    main()
