"""Data: peers training on a large corpus, prepared (memory-mapped token shards) against read whole.

A corpus of ``--mb`` MB (300 by default) of generated text (Zipf-distributed pseudo-words, seeded: the same
bytes every run, in 30 files) is prepared with ``p2ptrain data prepare`` twice, bytes and BPE, each timed and
its peak memory read from the kernel (the process's ru_maxrss). Then 2 peers of the default experiment train
``--rounds`` rounds on it three ways: ``data.source: text`` (the same text as one file, read whole into
memory), ``prepared`` with bytes, and ``prepared`` with the BPE. Each peer's processes are sampled every
0.2 s for VmHWM (the kernel's peak resident set of each process), until they exit: the peer process itself,
and the largest of its children (hivemind's DHT process; p2pd is Go and never sees the data).

Peers agree on the data by the manifest's hash: the two peers of each prepared run prepare their own copies
(in folders of their own) and must train together; the bench also checks that a copy prepared from other
text has another hash. Writes bench/results/data.json and the "data" table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from bench.report import replace_block
from p2ptrain.localswarm import closed_swarm_join, run_swarm
from p2ptrain.prepare import Manifest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "data.json"
FILES = 30


def generate(folder: Path, total_mb: int, seed: int = 0) -> int:
    """``total_mb`` MB of text in ``FILES`` files: lines of pseudo-words drawn Zipf-like (as words in text)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1 / np.arange(1, 27)
    lengths = rng.integers(2, 10, size=20_000)
    words = np.array(["".join(rng.choice(letters, n, p=weights / weights.sum())) for n in lengths])
    rank_p = 1 / np.arange(1, len(words) + 1) ** 1.1
    rank_p /= rank_p.sum()
    folder.mkdir(parents=True, exist_ok=True)
    per_file = total_mb * (1 << 20) // FILES
    written = 0
    for i in range(FILES):
        with (folder / f"part-{i:03d}.txt").open("w") as f:
            size = 0
            while size < per_file:
                ids = rng.choice(len(words), size=120_000, p=rank_p)
                line_ends = rng.random(len(ids)) < 1 / 12
                text = "".join(w + ("\n" if end else " ") for w, end in zip(words[ids], line_ends))
                f.write(text)
                size += len(text)
            written += size
    return written


def run_prepare(sources: list[str], out: Path, *extra: str) -> dict:
    """``p2ptrain data prepare`` as a child process: its wall time and peak RSS (ru_maxrss)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2ptrain", "data", "prepare", *sources, "--out", str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    out_text, err_text = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"data prepare failed: {err_text.strip()}")
    manifest = Manifest.read(out)
    return {
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
        "tokens": manifest.num_tokens,
        "vocab_size": manifest.vocab_size,
        "sha256": manifest.sha256,
        "printed": out_text.strip().splitlines()[0],
    }


class PeakSampler:
    """VmHWM of each process in a peer's tree, sampled until the peers exit."""

    def __init__(self) -> None:
        self.peaks: dict[int, dict[int, int]] = {}  # peer index -> pid -> peak bytes
        self.roots: dict[int, int] = {}
        self._stop = threading.Event()
        self._procs: list = []
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def started(self, procs: list) -> None:
        self._procs = procs  # run_swarm appends the others to this list as they start
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for p in list(self._procs):
                self.roots[p.index] = p.proc.pid
                try:
                    tree = [psutil.Process(p.proc.pid)]
                    tree += tree[0].children(recursive=True)
                except psutil.NoSuchProcess:
                    continue
                for proc in tree:
                    try:
                        if proc.name() == "p2pd":
                            continue
                        hwm = _vm_hwm(proc.pid)
                    except (psutil.NoSuchProcess, OSError):
                        continue
                    seen = self.peaks.setdefault(p.index, {})
                    seen[proc.pid] = max(seen.get(proc.pid, 0), hwm)
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def peer(self, index: int) -> tuple[float, float]:
        """(peak MB of the peer process, the largest peak MB among its children)."""
        seen = dict(self.peaks.get(index, {}))
        root = seen.pop(self.roots[index], 0)
        return root / 2**20, max(seen.values(), default=0) / 2**20


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def train(workdir: Path, data_sets: list[list[str]], rounds: int) -> dict:
    base, _ = closed_swarm_join(
        workdir,
        ROOT / "configs" / "default.yaml",
        [f"outer.num_rounds={rounds}", "swarm.min_peers=2", "device.num_threads=1"],
    )
    sampler = PeakSampler()
    start = time.monotonic()
    procs, codes = run_swarm(
        base,
        workdir,
        2,
        extra={i: [w for s in sets for w in ("--set", s)] for i, sets in enumerate(data_sets)},
        started=sampler.started,
        timeout_s=1800,
    )
    wall = time.monotonic() - start
    sampler.stop()
    if any(codes):
        raise SystemExit(f"a peer failed ({codes}): see {workdir}")
    losses = [s["val_loss"] for s in procs[0].outer_steps() if s.get("val_loss") is not None]
    peers = [sampler.peer(i) for i in range(2)]
    return {
        "peer_peak_rss_mb": [round(p[0], 1) for p in peers],
        "child_peak_rss_mb": [round(p[1], 1) for p in peers],
        "first_val_loss": losses[0] if losses else None,
        "final_val_loss": losses[-1] if losses else None,
        "group_sizes": [s.get("group_size") for s in procs[0].outer_steps()],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=300, help="Corpus size in MB.")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)

    tmp = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-data-"))
    try:
        corpus = tmp / "corpus"
        t0 = time.monotonic()
        size = generate(corpus, args.mb)
        print(f"generated {size / 2**20:.0f} MB in {time.monotonic() - t0:.0f} s", flush=True)
        whole = tmp / "corpus.txt"  # the same text as one file, for data.source text
        with whole.open("wb") as f:
            for part in sorted(corpus.iterdir()):
                f.write(part.read_bytes() + b"\n")  # prepare joins documents by a newline too

        prepared = {
            "byte": run_prepare([str(corpus)], tmp / "byte-0"),
            "bpe": run_prepare(
                [str(corpus)], tmp / "bpe-0", "--tokenizer", "bpe", "--vocab-size", str(args.vocab_size)
            ),
        }
        for kind, p in prepared.items():
            print(f"prepare {kind}: {p}", flush=True)
        # The second peer's own copy: prepared again, in a folder of its own (the BPE from the first's file, as a
        # volunteer would receive it), and a corpus with one file changed, which must hash otherwise.
        copies = {
            "byte": run_prepare([str(corpus)], tmp / "byte-1"),
            "bpe": run_prepare(
                [str(corpus)], tmp / "bpe-1", "--tokenizer", str(tmp / "bpe-0" / "tokenizer.json")
            ),
        }
        changed = tmp / "changed"
        shutil.copytree(corpus, changed)
        with (changed / "part-007.txt").open("a") as f:
            f.write("one more line\n")
        other = run_prepare([str(changed)], tmp / "byte-other")
        agree = {kind: copies[kind]["sha256"] == prepared[kind]["sha256"] for kind in prepared}
        differs = other["sha256"] != prepared["byte"]["sha256"]
        print(f"copies agree: {agree}; changed corpus hashes otherwise: {differs}", flush=True)

        runs = {}
        for name, sets in {
            "text (read whole)": [["data.source=text", f"data.path={whole}"]] * 2,
            "prepared, bytes": [["data.source=prepared", f"data.path={tmp / f'byte-{i}'}"] for i in range(2)],
            "prepared, BPE": [["data.source=prepared", f"data.path={tmp / f'bpe-{i}'}"] for i in range(2)],
        }.items():
            runs[name] = train(tmp / "runs" / name.split()[0].strip(","), sets, args.rounds) | {
                "source": sets[0][0].split("=")[1]
            }
            print(f"{name}: {runs[name]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    result = {
        "corpus_mb": round(size / 2**20, 1),
        "prepare": prepared,
        "copies_agree": agree,
        "changed_corpus_differs": differs,
        "runs": runs,
        "rounds": args.rounds,
        "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    replace_block("data", render(result).splitlines())
    print(render(result))


def render(r: dict) -> str:
    lines = [
        "| prepared with | wall | peak RSS of `data prepare` | tokens | ids |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for kind, p in r["prepare"].items():
        lines.append(
            f"| {kind} | {p['wall_s']:.0f} s | {p['peak_rss_mb']:.0f} MB | {p['tokens']:,} | {p['vocab_size']:,} |"
        )
    lines += [
        "",
        "| peers train on | peak RSS of each peer process | of its DHT child | val loss, first → last round | wall |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, run in r["runs"].items():
        peer = ", ".join(f"{m:.0f}" for m in run["peer_peak_rss_mb"])
        child = ", ".join(f"{m:.0f}" for m in run["child_peak_rss_mb"])
        loss = f"{run['first_val_loss']:.3f} → {run['final_val_loss']:.3f}" if run["final_val_loss"] else "—"
        lines.append(f"| {name} | {peer} MB | {child} MB | {loss} | {run['wall_s']:.0f} s |")
    agree = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["copies_agree"].items())
    lines += [
        "",
        f"Corpus: {r['corpus_mb']:.0f} MB of generated text in {FILES} files; 2 peers of `configs/default.yaml`, "
        f"{r['rounds']} rounds, one CPU thread each. Copies prepared separately by each peer hash alike: {agree}; "
        f"the corpus with one line added hashes otherwise: {'yes' if r['changed_corpus_differs'] else 'NO'}. "
        f"{r['machine']}, {r['date']}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
