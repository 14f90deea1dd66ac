"""``p2ptrain demo``: a real swarm on this machine.

Starts N ``p2ptrain join`` processes on 127.0.0.1 (the first one bootstraps, the others join
through it), follows their JSON logs to show each round, evaluates every peer's final model and
prints a summary. Every process it starts is stopped before it returns, also on Ctrl-C or errors.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from p2ptrain.config import ExperimentConfig
from p2ptrain.localswarm import LOOPBACK, PeerProcess, PeerProcessError, stop_all
from p2ptrain.plots import plot_loss


class DemoError(RuntimeError):
    pass


DEMO_FILE = re.compile(r"peer\d+(\.log)?")
"""What a demo writes for each peer in its workdir: ``peer<i>/`` (checkpoints, models) and ``peer<i>.log``."""


def clear_earlier_demo(workdir: Path) -> None:
    """Remove an earlier demo's peer files from ``workdir`` (never resumed, never mixed into this summary):
    only what a demo writes (:data:`DEMO_FILE`), so a user's own files there stay."""
    for old in workdir.glob("peer*"):
        if not DEMO_FILE.fullmatch(old.name):
            continue
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()


def run_demo(
    cfg: ExperimentConfig, *, peers: int, workdir: Path, config_path: Path | None, sets: list[str]
) -> dict[str, Any]:
    """Run the swarm to the end and return the summary (also printed)."""
    from p2ptrain.evaluation import Evaluator
    from p2ptrain.membership import generate_swarm_key

    t0 = time.monotonic()
    run_id = f"demo-{uuid.uuid4().hex[:8]}"  # a fresh run: never mix with an earlier demo's records
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    clear_earlier_demo(workdir)
    threads = cfg.device.num_threads or max(1, (os.cpu_count() or 1) // peers)
    base = ["join", "--host-maddrs", LOOPBACK, "--log-format", "json"]
    if cfg.swarm.key_file is None:  # a closed swarm, as a real one should be: only these peers hold the key
        key_file = workdir / "swarm.key"
        key_file.unlink(missing_ok=True)
        generate_swarm_key(key_file)
        base += ["--key-file", str(key_file)]
    if config_path is not None:
        base += ["--config", str(config_path)]
    for item in sets:
        base += ["--set", item]
    base += [
        "--set",
        f"run.run_id={run_id}",
        "--set",
        f"outer.num_rounds={cfg.outer.num_rounds}",
        "--set",
        f"device.num_threads={threads}",
        "--set",
        f"swarm.min_peers={peers}",
    ]

    evaluator = Evaluator()
    initial_val_loss = evaluator.initial(cfg)["val_loss"]

    print(
        f"p2ptrain demo: {peers} peers on 127.0.0.1, {cfg.model.name}, {cfg.outer.num_rounds} rounds of "
        f"{cfg.inner.num_inner_steps} inner steps, {threads} thread(s) each. Logs: {workdir}/peer*.log"
    )
    print(f"swarm key: {cfg.swarm.key_file or workdir / 'swarm.key'} (only its holders can join)")
    print(f"initial validation loss: {initial_val_loss:.4f}")
    rounds: dict[int, dict[int, dict]] = defaultdict(dict)
    lock = threading.Lock()

    def on_event(peer: PeerProcess, event: dict) -> None:
        if event.get("event") != "outer step":
            return
        with lock:
            r = int(event["round"])
            rounds[r][peer.index] = event
            if len(rounds[r]) == peers:
                rows = rounds[r].values()
                # One peer of each group evaluates a round (data.eval_by), or nobody (data.eval_every): the worst loss
                # any of them saw.
                val = max((e["val_loss"] for e in rows if e.get("val_loss") is not None), default=math.nan)
                print(
                    f"round {r + 1:>3}/{cfg.outer.num_rounds}  "
                    f"train loss {sum(e['train_loss'] for e in rows) / peers:.4f}  "
                    f"val loss {'     —' if math.isnan(val) else f'{val:.4f}'}  "
                    f"groups {sorted(e['group_size'] for e in rows)}  "
                    f"sent {sum(e['bytes_sent'] for e in rows) / peers / 1e6:.2f} MB/peer  "
                    f"{time.monotonic() - t0:6.1f}s",
                    flush=True,
                )

    procs: list[PeerProcess] = []
    first_maddr = ""
    try:
        for i in range(peers):
            peer_dir = workdir / f"peer{i}"
            cmd = base + ["--set", f"checkpoint.dir={peer_dir}"]
            if i > 0:
                cmd += ["--initial-peers", first_maddr]
            procs.append(PeerProcess(cmd, workdir / f"peer{i}.log", on_event=on_event, index=i))
            if i == 0:
                try:
                    first_maddr = procs[0].wait_for_maddr(timeout_s=90)
                except PeerProcessError as e:
                    raise DemoError(f"the first peer: {e}") from None
        deadline = time.monotonic() + _run_timeout_s(cfg)
        while any(p.proc.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the swarm did not finish within {_run_timeout_s(cfg):.0f}s; see {workdir}/peer*.log"
                )
            failed = [p for p in procs if p.proc.poll() not in (None, 0)]
            if failed:
                p = failed[0]
                raise DemoError(f"peer {p.index} exited with code {p.proc.returncode}; see {p.log_path}")
            time.sleep(0.5)
        failed = [p for p in procs if p.proc.returncode != 0]
        if failed:
            raise DemoError(
                f"peer {failed[0].index} exited with code {failed[0].proc.returncode}; see {failed[0].log_path}"
            )
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the peers", file=sys.stderr)
        raise
    finally:
        stop_all(procs)

    per_peer = []
    for i in range(peers):
        path = workdir / f"peer{i}" / "final.safetensors"
        loaded, metrics = evaluator.file(path)
        per_round = [e.get("bytes_sent", 0) for e in procs[i].outer_steps()]
        per_peer.append(
            {
                "path": str(path),
                "sha256": loaded.params_sha256(),
                "bytes_sent": sum(per_round),
                "bytes_sent_per_round": per_round,
                **metrics,
            }
        )

    plot_path = plot_loss(
        {
            # Round 0 is the shared initial model; round r + 1 holds the params after the r-th outer step.
            f"peer {p.index}": [(0, initial_val_loss)]
            + [
                (int(e["round"]) + 1, float(e["val_loss"]))
                for e in p.outer_steps()
                if e.get("val_loss") is not None
            ]
            for p in procs
        },
        workdir / "val_loss.png",
        title=f"p2ptrain demo: {peers} peers, {cfg.model.name}, validation loss after each round",
        baseline=initial_val_loss,
    )
    final_losses = [p["val_loss"] for p in per_peer]
    hashes = [p["sha256"] for p in per_peer]
    samples_total = sum(int(e.get("samples", 0)) for p in procs for e in p.outer_steps())
    identical = len(set(hashes)) == 1
    learned = max(final_losses) < initial_val_loss - 0.1
    summary = {
        "ok": identical and learned,
        "peers": peers,
        "rounds": cfg.outer.num_rounds,
        "model": cfg.model.name,
        "initial_val_loss": initial_val_loss,
        "final_val_loss": max(final_losses),
        "final_val_loss_per_peer": final_losses,
        "final_params_sha256": hashes,
        **(
            {"final_test_accuracy": min(p["test_accuracy"] for p in per_peer)}
            if all("test_accuracy" in p for p in per_peer)
            else {}
        ),
        "params_identical": identical,
        "samples_total": samples_total,
        "compression": cfg.averaging.compression,
        "bytes_sent_per_peer": [p["bytes_sent"] for p in per_peer],
        "bytes_sent_per_round": [p["bytes_sent_per_round"] for p in per_peer],
        "wall_s": round(time.monotonic() - t0, 1),
        "plot": str(plot_path),
    }
    _print_summary(summary, per_peer)
    return summary


def _run_timeout_s(cfg: ExperimentConfig) -> float:
    # Generous: an honest swarm on a slow laptop finishes far sooner; this only turns a hang into an error.
    per_round = cfg.averaging.barrier_timeout_s + cfg.averaging.allreduce_timeout_s + 60
    return 120 + cfg.outer.num_rounds * per_round + cfg.swarm.linger_s


def _print_summary(summary: dict, per_peer: list[dict]) -> None:
    images = "final_test_accuracy" in summary  # an image classifier: test accuracy instead of perplexity
    print()
    third = "test acc" if images else "perplexity"
    print(f"{'peer':<6}{'val loss':>10}{third:>12}{'accuracy':>10}{'MB sent':>10}  params sha256")
    for i, p in enumerate(per_peer):
        print(
            f"{i:<6}{p['val_loss']:>10.4f}"
            + (f"{p['test_accuracy']:>12.4f}" if images else f"{p['perplexity']:>12.2f}")
            + f"{p['accuracy']:>10.3f}{p['bytes_sent'] / 1e6:>10.2f}  {p['sha256'][:16]}"
        )
    print()
    if images:
        print(
            f"test accuracy {summary['final_test_accuracy']:.4f} (worst peer, "
            f"{per_peer[0]['test_images']} test images)"
        )
    print(
        f"validation loss {summary['initial_val_loss']:.4f} -> {summary['final_val_loss']:.4f} "
        f"(worst peer), {summary['samples_total']} samples, {summary['wall_s']}s"
    )
    print("all peers hold identical params" if summary["params_identical"] else "PEERS DISAGREE ON PARAMS")
    print(f"validation loss per round: {summary['plot']}")
