"""Compression benchmark: codec speed, and a sweep of wire formats on the default experiment.

1. Speed: encode + decode of one 100M-element float32 tensor per codec, next to a plain copy of the
   same tensor (torch threads = CPUs), best of 3.
2. Sweep: the default experiment with N real peers (`p2ptrain demo`) per wire format — none, fp16,
   int8, int4, int4 + error feedback — and `none` once more, so that run-to-run noise (peer ids
   decide the data shards) is measured rather than assumed. Bytes per peer per round are the
   all-reduce payload counted by p2ptrain's runner (sent, both directions of the butterfly).

    python -m bench.compression [--peers 3] [--numel 100000000] [--skip-sweep]

Writes bench/results/compression.json and the compression tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from hivemind.compression import CompressionInfo

from bench.report import DOC, replace_block
from p2ptrain.compression import BlockwiseQuantization, deserialize, make_codec
from p2ptrain.config import load_config, parse_set
from p2ptrain.demo import run_demo

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "none": ["averaging.compression=none"],
    "fp16": ["averaging.compression=fp16"],
    "int8": ["averaging.compression=int8"],
    "int4": ["averaging.compression=int4"],
    "int4+ef": ["averaging.compression=int4", "averaging.error_feedback=true"],
    "none (repeat)": ["averaging.compression=none"],
}


def best_of(fn, repeats: int = 3) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def codec_speed(numel: int) -> dict:
    torch.set_num_threads(os.cpu_count() or 1)
    x = torch.randn(numel)
    info = CompressionInfo.from_tensor(x)
    copy_s, _ = best_of(lambda: x.clone())
    out = {"numel": numel, "threads": torch.get_num_threads(), "copy_s": copy_s, "codecs": {}}
    for name, codec in [
        ("fp16", make_codec("fp16")),
        ("int8", BlockwiseQuantization(8)),
        ("int4", BlockwiseQuantization(4)),
    ]:
        encode_s, serialized = best_of(lambda codec=codec: codec.compress(x, info))
        decode_s, _ = best_of(lambda serialized=serialized: deserialize(serialized))
        out["codecs"][name] = {
            "encode_s": encode_s,
            "decode_s": decode_s,
            "total_over_copy": (encode_s + decode_s) / copy_s,
            "bytes_over_fp32": len(serialized.buffer) / (4 * numel),
        }
        print(
            f"  {name}: encode {encode_s:.3f}s + decode {decode_s:.3f}s "
            f"= {(encode_s + decode_s) / copy_s:.1f}x a copy ({copy_s:.3f}s)",
            flush=True,
        )
    return out


def sweep(peers: int, config: Path | None, sets: list[str]) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(VARIANTS.items()):
            print(f"[{i + 1}/{len(VARIANTS)}] {name}", flush=True)
            run_sets = [*sets, *extra]
            cfg = load_config(config, parse_set(run_sets))
            summary = run_demo(
                cfg, peers=peers, workdir=Path(tmp) / f"run{i}", config_path=config, sets=run_sets
            )
            per_round = [b for rounds in summary["bytes_sent_per_round"] for b in rounds]
            results[name] = {
                "val_loss": summary["final_val_loss"],
                "params_identical": summary["params_identical"],
                "bytes_sent_per_peer_per_round": sum(per_round) / len(per_round),
                "wall_s": summary["wall_s"],
            }
    fp32 = results["none"]["bytes_sent_per_peer_per_round"]
    for r in results.values():
        r["bytes_over_fp32"] = r["bytes_sent_per_peer_per_round"] / fp32
        r["val_loss_over_none"] = r["val_loss"] / results["none"]["val_loss"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "compression.json")
    args = ap.parse_args()
    print(f"codec speed on {args.numel:,} float32 values", flush=True)
    result: dict = {"speed": codec_speed(args.numel), "date": time.strftime("%Y-%m-%d")}
    if not args.skip_sweep:
        result["sweep"] = sweep(args.peers, args.config, args.sets)
        result["sweep_setup"] = {
            "peers": args.peers,
            "config": str(args.config or "built-in default"),
            "sets": args.sets,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    write_tables(result)
    print(f"wrote {args.out} and the compression tables in {DOC.relative_to(ROOT)}")


def write_tables(r: dict) -> None:
    s = r["speed"]
    rows = [
        f"Encode + decode of {s['numel']:,} float32 values ({s['threads']} threads, best of 3); a plain copy "
        f"takes {s['copy_s']:.3f} s.",
        "",
        "| codec | encode | decode | total / copy | bytes / fp32 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, c in s["codecs"].items():
        rows.append(
            f"| {name} | {c['encode_s']:.3f} s | {c['decode_s']:.3f} s | {c['total_over_copy']:.1f}x | "
            f"{c['bytes_over_fp32']:.3f} |"
        )
    if "sweep" in r:
        rows += [
            "",
            f"The default experiment, {r['sweep_setup']['peers']} peers, one real swarm per row:",
            "",
            "| wire format | val loss | / none | bytes per peer per round | / fp32 | identical params | wall |",
            "| --- | ---: | ---: | ---: | ---: | :---: | ---: |",
        ]
        for name, v in r["sweep"].items():
            rows.append(
                f"| {name} | {v['val_loss']:.4f} | {v['val_loss_over_none']:.4f} | "
                f"{v['bytes_sent_per_peer_per_round'] / 1e6:.2f} MB | {v['bytes_over_fp32']:.3f} | "
                f"{'yes' if v['params_identical'] else 'NO'} | {v['wall_s']:.0f} s |"
            )
    rows.append("")
    rows.append(f"Measured {r['date']}.")
    replace_block("compression", rows)


if __name__ == "__main__":
    main()
