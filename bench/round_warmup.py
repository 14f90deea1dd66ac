"""What a verifiable round's fresh AdamW costs, apart from replicated shards, and what a per-round lr ramp
recovers: ``bench.simulate`` (in-process DiLoCo, exact averaging) on the default experiment, 4 peers.

    python -m bench.round_warmup

Writes bench/results/round-warmup.json and the round-warmup table of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from bench.report import DOC, RESULTS, replace_block
from bench.simulate import simulate
from p2ptrain.config import load_config

ROOT = Path(__file__).resolve().parent.parent
PEERS = 4
CASES = [
    ("an AdamW kept across rounds (no verification)", {}),
    ("a fresh AdamW every round", {"fresh_inner": True}),
    ("replicated shards (k = 2), AdamW kept", {"replicas": 2}),
    ("both: verifiable rounds without a ramp", {"fresh_inner": True, "replicas": 2}),
    ("a fresh AdamW, lr ramped over 3 steps", {"fresh_inner": True, "round_warmup": 3}),
    ("a fresh AdamW, lr ramped over 5 steps", {"fresh_inner": True, "round_warmup": 5}),
    ("a fresh AdamW, lr ramped over 8 steps", {"fresh_inner": True, "round_warmup": 8}),
    (
        "verifiable rounds now (k = 2, fresh AdamW, 5-step ramp)",
        {"fresh_inner": True, "replicas": 2, "round_warmup": 5},
    ),
]


def _args(kwargs: dict) -> str:
    flags = {"fresh_inner": "--fresh-inner", "replicas": "--replicas", "round_warmup": "--round-warmup"}
    return " ".join(flags[k] if v is True else f"{flags[k]} {v}" for k, v in kwargs.items())


def main() -> None:
    cfg = load_config(ROOT / "configs" / "default.yaml")
    runs = []
    for case, kwargs in CASES:
        t0 = time.monotonic()
        result = simulate(cfg, PEERS, **kwargs)
        runs.append(
            {
                "case": case,
                "args": _args(kwargs),
                "final_val_loss": round(result["val_loss"], 4),
                "wall_s": round(time.monotonic() - t0, 1),
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    base = runs[0]["final_val_loss"]
    out = {
        "experiment": {
            "config": "configs/default.yaml",
            "peers": PEERS,
            "rounds": cfg.outer.num_rounds,
            "inner_steps": cfg.inner.num_inner_steps,
        },
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "runs": runs,
    }
    (RESULTS / "round-warmup.json").write_text(json.dumps(out, indent=2) + "\n")
    rows = ["| case | `bench.simulate` arguments | final val loss |", "| --- | --- | ---: |"]
    for r in runs:
        ratio = "" if r is runs[0] else f" ({r['final_val_loss'] / base - 1:+.0%})"
        args = f"`{r['args']}`" if r["args"] else ""
        rows.append(f"| {r['case']} | {args} | {r['final_val_loss']:.3f}{ratio} |")
    replace_block("round-warmup", rows, DOC)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
