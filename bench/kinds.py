"""Experiment kinds: each shipped config (configs/*.yaml) trained by `p2ptrain demo` (3 real peer processes on
127.0.0.1) on this machine, one after another, with its final metric and wall time.

- default.yaml: gpt-micro on Python's documentation, bytes.
- tiny.yaml: gpt-nano, the smoke test.
- llama.yaml: llama-micro on Python's documentation prepared with a BPE of ``--vocab-size`` ids trained on it
  (``p2ptrain data prepare``, timed apart), as its first lines say.
- digits.yaml: cnn-small on scikit-learn's 8x8 digits; the metric is test accuracy on the 359 held-out
  digits that no peer trains on.
- mnist.yaml is not run: it needs MNIST's files, which nothing here downloads.

Text metrics are per token; bits per byte (final val loss / ln 2 x tokens per byte of the text) puts the
bytes and the BPE on one scale. Wall time is the demo's (`wall_s` of its summary: from its start, peers'
start-up included, to the last peer's final model), with every peer on one thread. Writes
bench/results/kinds.json and the "kinds" table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.report import replace_block
from p2ptrain.config import load_config
from p2ptrain.data import load_corpus, open_corpus
from p2ptrain.models import build_model, num_params
from p2ptrain.prepare import Manifest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "kinds.json"


def run_demo(config: str, sets: list[str], workdir: Path) -> dict:
    summary_path = workdir / "summary.json"
    command = [sys.executable, "-m", "p2ptrain", "demo", "--config", str(ROOT / "configs" / config)]
    for item in sets:
        command += ["--set", item]
    command += ["--workdir", str(workdir), "--summary-json", str(summary_path)]
    started = time.monotonic()
    out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(
            f"demo of {config} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    summary = json.loads(summary_path.read_text())
    summary["process_wall_s"] = round(time.monotonic() - started, 1)
    return summary


def describe(config: str, sets: list[str]) -> dict:
    overrides: dict = {}
    for item in sets:
        key, value = item.split("=", 1)
        section, field = key.split(".")
        overrides.setdefault(section, {})[field] = value
    cfg = load_config(ROOT / "configs" / config, overrides)
    data = open_corpus(cfg.data, cfg.model.context_length, cfg.data.val_fraction)
    model = build_model(cfg.model.name, cfg.model.context_length, **data.model_args())
    return {
        "model": cfg.model.name,
        "params": num_params(model),
        "rounds": cfg.outer.num_rounds,
        "inner_steps": cfg.inner.num_inner_steps,
        "batch_size": cfg.inner.batch_size,
        "source": cfg.data.source,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2048, help="The BPE of the llama run.")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="p2pt-kinds-") as tmp:
        work = Path(tmp)
        text = work / "pydoc.txt"
        text.write_bytes(load_corpus(load_config(None).data))
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "p2ptrain", "data", "prepare", str(text), "--out", str(work / "bpe")]
            + ["--tokenizer", "bpe", "--vocab-size", str(args.vocab_size)],
            check=True,
            capture_output=True,
        )
        prepare_s = round(time.monotonic() - started, 1)
        bpe_tokens_per_byte = Manifest.read(work / "bpe").num_tokens / text.stat().st_size
        kinds = [
            ("default.yaml", [], "Python's documentation, bytes (0.47 MB)", 1.0),
            ("tiny.yaml", [], "Python's documentation, bytes", 1.0),
            (
                "llama.yaml",
                ["data.source=prepared", f"data.path={work / 'bpe'}"],
                f"Python's documentation, BPE of {args.vocab_size} ids (prepared in {prepare_s} s)",
                bpe_tokens_per_byte,
            ),
            ("digits.yaml", [], "scikit-learn's 8x8 digits (1,797; 359 for test)", None),
        ]
        for config, sets, data, tokens_per_byte in kinds:
            print(f"{config} ...", flush=True)
            summary = run_demo(config, sets, work / config.removesuffix(".yaml"))
            row = {
                "config": config,
                **describe(config, sets),
                "data": data,
                "initial_val_loss": round(summary["initial_val_loss"], 4),
                "final_val_loss": round(summary["final_val_loss"], 4),
                "test_accuracy": summary.get("final_test_accuracy"),
                "tokens_per_byte": tokens_per_byte,
                "val_bits_per_byte": None
                if tokens_per_byte is None
                else round(summary["final_val_loss"] / math.log(2) * tokens_per_byte, 3),
                "params_identical": summary["params_identical"],
                "samples": summary["samples_total"],
                "wall_s": summary["wall_s"],
                "process_wall_s": summary["process_wall_s"],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "peers": 3,
        "kinds": rows,
        "not_run": {"mnist.yaml": "needs MNIST's IDX files, which nothing here downloads"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    replace_block("kinds", render(result).splitlines())


def render(result: dict) -> str:
    lines = [
        "| config | model | params | data | rounds x steps | final metric | wall time |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["kinds"]:
        metric = (
            f"test accuracy {r['test_accuracy']:.4f} (val loss {r['final_val_loss']:.3f})"
            if r["test_accuracy"] is not None
            else f"val loss {r['initial_val_loss']:.3f} -> {r['final_val_loss']:.3f} "
            f"({r['val_bits_per_byte']:.2f} bits/byte)"
        )
        params = f"{r['params'] / 1e6:.2f}M" if r["params"] >= 1e5 else f"{r['params'] / 1e3:.0f}k"
        lines.append(
            f"| `{r['config']}` | {r['model']} | {params} | {r['data']} | {r['rounds']} x {r['inner_steps']} "
            f"| {metric} | {r['wall_s']:.0f} s |"
        )
    for config, why in result["not_run"].items():
        lines.append(f"| `{config}` | | | | | not run: {why} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
