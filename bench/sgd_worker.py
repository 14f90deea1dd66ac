"""Baselines for bench.quality: one process alone, or one rank of synchronous data-parallel (DDP, gloo).

Same model, data shards, inner optimizer and schedule as a p2ptrain peer, so that the only difference
is how the peers communicate: DDP all-reduces gradients after every step.

    python -m bench.sgd_worker --config C --rank R --world N --port P --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from p2ptrain.config import load_config, parse_set
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.evaluation import evaluate
from p2ptrain.inner import inner_lr, inner_step, make_optimizer
from p2ptrain.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cfg = load_config(args.config, parse_set(args.set))
    torch.set_num_threads(args.threads)

    distributed = args.world > 1
    if distributed:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world
        )
    corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    model = build_model(cfg.model.name, cfg.model.context_length, cfg.model.dropout, seed=cfg.run.seed)
    train_model = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg.inner)
    steps = 0
    t0 = time.monotonic()
    for round_ in range(cfg.outer.num_rounds):
        # The same shard a p2ptrain peer of this rank would train on in this round.
        starts = corpus.shard(seed=cfg.run.seed, round=round_, rank=args.rank, world=args.world)
        batches = corpus.batches(starts, cfg.inner.batch_size)
        for _ in range(cfg.inner.num_inner_steps):
            x, y = next(batches)
            # The peer's own inner step; through DDP, backward() all-reduces the gradients.
            inner_step(
                train_model, params, opt, x, y, lr=inner_lr(cfg.inner, steps), grad_clip=cfg.inner.grad_clip
            )
            steps += 1
    train_s = time.monotonic() - t0
    result = {"rank": args.rank, "steps": steps, "train_s": train_s}
    if args.rank == 0:
        result.update(evaluate(model, corpus, cfg, torch.device("cpu")))
        result["samples_per_rank"] = steps * cfg.inner.batch_size
        result["params"] = sum(p.numel() for p in model.parameters())
    args.out.write_text(json.dumps(result))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # gloo's background threads can hold interpreter shutdown up


if __name__ == "__main__":
    main()
