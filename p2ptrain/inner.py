"""The inner step: one local AdamW step on a batch, its learning-rate schedule, and the device it runs on.

The trainer and the benchmarks (``bench/simulate.py``, ``bench/sgd_worker.py``) all train with these, so
that a benchmark measures what a peer does, not a copy of it that has drifted.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2ptrain.config import InnerConfig
from p2ptrain.models import GLOBAL_RNG_LOCK, flops_per_sample


def pick_device(kind: str) -> torch.device:
    """auto: Apple's MPS, then CUDA, then CPU."""
    if kind == "auto":
        if torch.backends.mps.is_available():
            return torch.device("mps")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device.kind is 'cuda' but torch sees no CUDA device")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device.kind is 'mps' but MPS is not available (Apple Silicon and macOS 12.3+ only)")
    return torch.device(kind)


def make_optimizer(params: Iterable[nn.Parameter], cfg: InnerConfig) -> torch.optim.Optimizer:
    """The inner optimizer of ``inner.optimizer`` (AdamW)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def inner_lr(cfg: InnerConfig, step: int) -> float:
    """The learning rate of local step ``step`` (counted from 0 across rounds): linear warmup, then flat."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


def round_warmup(step_in_round: int, steps: int) -> float:
    """The factor of the learning rate at step ``step_in_round`` of a verifiable round: a ramp over the
    round's first ``steps`` steps (``verification.round_warmup_steps``), for its fresh AdamW."""
    return min(1.0, (step_in_round + 1) / steps) if steps else 1.0


def inner_step(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    grad_clip: float,
    autocast_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One step: forward (autocast unless float32), cross-entropy, backward, clip, AdamW.

    Args:
        model: what runs the forward pass (the model itself, or a DDP wrapper of it).
        params: the params to clip (the model's trainable ones).
        x, y: (B, T) int64 inputs and next-token targets, on the model's device.

    Returns:
        The loss, a 0-dim tensor still on the device: reading it is a host sync, so callers sum it there.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
        logits = model(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def replica_steps(cfg: InnerConfig, speeds: Sequence[float]) -> int:
    """The steps every replica of a shard does in a verifiable round: H, or with ``inner.round_seconds`` what
    the slowest replica's published benchmark (samples/s) fits in the round (at least 1, at most H). A pure
    function of the records, so that replicas do the same steps and every verdict weighs them alike. A replica
    that published no benchmark counts as the slowest there is (1 step): claiming to be slow saves a peer work
    and weight alike, and claiming to be fast cannot make its partners train longer than they can."""
    if not cfg.round_seconds:
        return cfg.num_inner_steps
    slowest = min(speeds, default=0.0)
    return max(1, min(cfg.num_inner_steps, int(cfg.round_seconds * slowest / cfg.batch_size)))


def benchmark_device(
    model: nn.Module,
    cfg: InnerConfig,
    *,
    batch: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    autocast_dtype: torch.dtype = torch.float32,
) -> tuple[float, float]:
    """This device's speed at ``model``'s inner steps: (samples/s, FLOP/s), the latter from
    ``models.flops_per_sample``. Times ``steps`` steps of a copy of the model on ``batch`` (inputs and
    targets of one training batch, ``data.example_batch``), after one untimed step: the model, its optimizer
    and the random number generators that training draws from are untouched."""
    probe = copy.deepcopy(model)
    params = [p for p in probe.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr)
    device = next(probe.parameters()).device
    x, y = batch[0].to(device), batch[1].to(device)
    # Dropout draws from the global generator, and fork_rng sets its state back at the end: under the lock, so
    # that neither lands in the middle of another in-process peer's model build.
    with GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        started = 0.0
        for i in range(steps + 1):
            if i == 1:  # the first step pays for allocations and kernels' warm-up
                _synchronize(device)
                started = time.perf_counter()
            inner_step(
                probe,
                params,
                optimizer,
                x,
                y,
                lr=cfg.lr,
                grad_clip=cfg.grad_clip,
                autocast_dtype=autocast_dtype,
            )
        _synchronize(device)
    seconds = max(time.perf_counter() - started, 1e-9)
    samples_per_s = steps * len(x) / seconds
    return samples_per_s, flops_per_sample(probe) * samples_per_s


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
