"""One peer's training loop: inner steps, then an outer sync with the swarm, round after round.

Read :meth:`Trainer.run` top to bottom; every phase is a method below it, in the order it runs.

Round agreement, in short (details in docs/architecture.md): every peer publishes a signed
progress record (round, state, params hash). A peer behind the swarm's highest round downloads
the state of a peer that has it. After its inner phase a peer waits until every live peer of its
round has finished its own (or ``averaging.barrier_timeout_s`` passes), checks that they all
hold the same params (if not, it rebases its inner progress onto the canonical params first), and
averages with them in one round-keyed all-reduce.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from p2ptrain import checkpoint, telemetry
from p2ptrain.averaging import SwarmAverager
from p2ptrain.compression import ErrorFeedback, make_codec
from p2ptrain.config import ExperimentConfig
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.diloco import DiLoCo, OuterStepReport, tensors_hash
from p2ptrain.logs import bind, get_logger
from p2ptrain.models import build_model, num_params
from p2ptrain.progress import InnerProgress, terminal_progress_enabled
from p2ptrain.swarm import ProgressRecord, Swarm, canonical_hash

log = get_logger(__name__)


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


@dataclass
class RoundStats:
    loss_sum: float = 0.0
    steps: int = 0
    samples: int = 0
    started: float = field(default_factory=time.monotonic)
    inner_s: float = 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.steps, 1)


class Trainer:
    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        stop: threading.Event | None = None,
        on_started: Callable[[list[str]], None] | None = None,
    ):
        """
        Args:
            cfg: the resolved experiment config.
            stop: set it (from a signal handler, a test) to stop cleanly at the next safe point.
            on_started: called with this peer's multiaddrs once it is in the swarm.
        """
        self.cfg = cfg
        self.stop = stop or threading.Event()
        self.on_started = on_started
        self.swarm: Swarm | None = None
        self.averager: SwarmAverager | None = None
        self.maddrs: list[str] = []
        self.final_path: Path | None = None
        self.val_losses: list[tuple[int, float]] = []
        self._unreachable: dict[str, float] = {}  # peer id -> monotonic time until which we don't ask it

    @property
    def round(self) -> int:
        return self.diloco.round

    # ---------------------------------------------------------------------------------- the loop

    def run(self) -> Path | None:
        """Train until ``outer.num_rounds`` or a stop request; return the final model's path (None if stopped)."""
        try:
            self.setup()
            if self.on_started is not None:
                self.on_started(self.maddrs)
            self.join_swarm()
            while not self.stop.is_set():
                self.catch_up()  # may jump several rounds, up to the end of the run
                bind(round=self.round)
                if self.round >= self.cfg.outer.num_rounds:
                    break
                stats = self.inner_phase()
                if self.stop.is_set():
                    break
                peers = self.wait_for_peers()
                if peers is None:  # the swarm moved on while we trained: our pseudo-gradient is stale
                    if not self.stop.is_set():
                        telemetry.OUTER_STEP_FAILURES.labels(reason="stale").inc()
                    continue
                report = self.outer_sync(peers, stats)
                self.log_round(report, stats)
                self.maybe_checkpoint()
            if self.round >= self.cfg.outer.num_rounds:
                self.finish()
            else:
                self.save(self.checkpoint_dir / "interrupted.safetensors")
        finally:
            self.shutdown()
        return self.final_path

    # ------------------------------------------------------------------------------ the phases

    def setup(self) -> None:
        cfg = self.cfg
        # The DHT forks: create it before touching CUDA (and after logging is configured).
        self.device = pick_device(cfg.device.kind)
        self.swarm = Swarm(cfg.run.run_id, cfg.swarm, device=self.device.type)
        self.peer_id = self.swarm.peer_id
        bind(peer_id=self.peer_id[-8:])
        self.maddrs = self.swarm.visible_maddrs()

        self.corpus = Corpus.from_bytes(
            load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction
        )
        self.model = build_model(
            cfg.model.name, cfg.model.context_length, cfg.model.dropout, seed=cfg.run.seed
        )
        self.model.to(self.device)
        error_feedback = None
        if cfg.averaging.error_feedback:
            codec = make_codec(
                cfg.averaging.compression,
                block_size=cfg.averaging.block_size,
                small_tensor_numel=cfg.averaging.small_tensor_numel,
            )
            error_feedback = ErrorFeedback(
                codec, [p.shape for p in self.model.parameters() if p.requires_grad]
            )
        self.diloco = DiLoCo(
            self.model,
            lr=cfg.outer.lr,
            momentum=cfg.outer.momentum,
            nesterov=cfg.outer.nesterov,
            error_feedback=error_feedback,
        )
        self.inner_opt = torch.optim.AdamW(
            self.diloco.model_params,
            lr=cfg.inner.lr,
            betas=cfg.inner.betas,
            weight_decay=cfg.inner.weight_decay,
        )
        self.inner_steps_total = 0
        self.samples_total = 0
        if cfg.checkpoint.resume:
            self.resume_from_checkpoint()
        self.averager = SwarmAverager(
            self.swarm.dht,
            run_id=cfg.run.run_id,
            shapes=[m.shape for m in self.diloco.master],
            cfg=cfg.averaging,
            client_mode=cfg.swarm.client_mode,
            state_provider=self._state_for_donation,
            stop=self.stop,
        )
        # Only now, after the averager child has forked: torch.set_num_threads creates a thread pool that a
        # forked child inherits broken, and the child's first parallel op in a new thread then fails with
        # "Invalid thread pool!" (its all-reduce stalls until groupmates time it out).
        if cfg.device.num_threads:
            torch.set_num_threads(cfg.device.num_threads)
        if cfg.metrics.port:  # after the forks: a child must not inherit the listening socket
            telemetry.serve(cfg.metrics.port, cfg.metrics.host)
        telemetry.set_peer_info(
            peer_id=self.peer_id, run_id=cfg.run.run_id, device=self.device.type, model=cfg.model.name
        )
        telemetry.ROUND.set(self.round)
        self.swarm.update(round=0, state="loading", params_hash=self.diloco.params_hash())
        log.info(
            "peer started",
            run_id=cfg.run.run_id,
            device=str(self.device),
            model=cfg.model.name,
            params=num_params(self.model),
            maddrs=self.maddrs,
            config_hash=cfg.training_hash(),
        )

    def join_swarm(self) -> None:
        """Publish ourselves; if peers of this run exist, start from their state, not from scratch."""
        assert self.swarm is not None
        self.swarm.start_heartbeat()
        cfg = self.cfg.swarm
        if cfg.initial_peers or cfg.initial_peers_file:
            # Records take a moment to reach a new DHT node; give the swarm two heartbeats to show up.
            deadline = time.monotonic() + 2 * cfg.heartbeat_s + 1
            while time.monotonic() < deadline and not self._others() and not self.stop.is_set():
                time.sleep(self._poll_s)
        if cfg.min_peers > 1:
            deadline = time.monotonic() + cfg.min_peers_timeout_s
            log.info("waiting for peers", min_peers=cfg.min_peers)
            while len(self._others()) + 1 < cfg.min_peers and not self.stop.is_set():
                if time.monotonic() > deadline:
                    log.warning(
                        "starting without swarm.min_peers",
                        min_peers=cfg.min_peers,
                        present=len(self._others()) + 1,
                    )
                    break
                time.sleep(self._poll_s)
        self.catch_up()
        self.swarm.update(state="training")

    def catch_up(self) -> None:
        """If live peers hold a later round than ours, download their state and continue from it."""
        others = self._others()
        now = time.monotonic()
        ahead = [
            r
            for r in others.values()
            if r.round > self.round
            and r.state != "loading"
            and r.params_hash
            and self._unreachable.get(r.peer_id, 0.0) < now
        ]
        if not ahead:
            return
        target = max(r.round for r in ahead)
        holders = [r for r in ahead if r.round == target]
        canon = canonical_hash(holders)
        donors = [
            r.peer_id for r in sorted(holders, key=lambda r: -r.samples_total) if r.params_hash == canon
        ]
        log.info("behind the swarm, loading state", round=self.round, swarm_round=target, donors=len(donors))
        assert self.swarm is not None
        self.swarm.update(state="loading")
        if not self.load_state_from(donors, rebase=False):
            # Don't ask them again until their records could have expired: they may be gone.
            for donor in donors:
                self._unreachable[donor] = time.monotonic() + self.cfg.swarm.record_ttl_s
            log.warning("could not load the swarm's state; training on from our own", round=self.round)
        self.swarm.update(state="training")

    def inner_phase(self) -> RoundStats:
        """H local AdamW steps on this peer's shard of the round."""
        cfg, swarm = self.cfg, self.swarm
        assert swarm is not None
        rank, world = self._rank_in_round()
        starts = self.corpus.shard(seed=cfg.run.seed, round=self.round, rank=rank, world=world)
        batches = self.corpus.batches(starts, cfg.inner.batch_size)
        stats = RoundStats()
        swarm.update(state="training", samples_round=0)
        self.model.train()
        last_beat = time.monotonic()
        loss_sum = torch.zeros((), device=self.device)  # summed on device: no host sync per step
        bar = InnerProgress(
            terminal_progress_enabled(cfg.log.format), total=cfg.inner.num_inner_steps, round=self.round
        )
        running_loss = lambda: float(loss_sum) / max(stats.steps, 1)  # noqa: E731 - read only when the bar redraws
        with bar:
            for _ in range(cfg.inner.num_inner_steps):
                if self.stop.is_set():
                    break
                loss = self._inner_step(batches)
                loss_sum.add_(loss.detach())
                stats.steps += 1
                stats.samples += cfg.inner.batch_size
                bar.update(stats.steps, stats.samples, running_loss)
                if time.monotonic() - last_beat > cfg.swarm.heartbeat_s:
                    last_beat = time.monotonic()
                    elapsed = last_beat - stats.started
                    swarm.update(
                        samples_round=stats.samples, samples_per_s=stats.samples / max(elapsed, 1e-9)
                    )
        stats.loss_sum = float(loss_sum)
        self.samples_total += stats.samples
        elapsed = time.monotonic() - stats.started
        stats.inner_s = elapsed
        telemetry.INNER_STEPS.inc(stats.steps)
        telemetry.SAMPLES.inc(stats.samples)
        if stats.steps:
            telemetry.INNER_STEP_DURATION.observe(elapsed / stats.steps)
            telemetry.TRAIN_LOSS.set(stats.loss)
            telemetry.SAMPLES_PER_SECOND.set(stats.samples / max(elapsed, 1e-9))
        swarm.update(
            samples_round=stats.samples,
            samples_total=self.samples_total,
            samples_per_s=stats.samples / max(elapsed, 1e-9),
        )
        return stats

    def _inner_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        cfg = self.cfg
        x, y = next(batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        for group in self.inner_opt.param_groups:
            group["lr"] = self._inner_lr()
        dtype = getattr(torch, cfg.device.dtype)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = self.model(x)  # (B, T, 256)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.diloco.model_params, cfg.inner.grad_clip)
        self.inner_opt.step()
        self.inner_opt.zero_grad(set_to_none=True)
        self.inner_steps_total += 1
        return loss

    def wait_for_peers(self) -> list[ProgressRecord] | None:
        """The barrier: wait for this round's other peers to finish their inner phase.

        Returns the records of the peers to average with (possibly none), or None if the swarm moved to
        a later round meanwhile (we then load its state and our pseudo-gradient is dropped as stale) or a
        stop was requested.
        """
        assert self.swarm is not None
        self.swarm.update(state="averaging")
        deadline = time.monotonic() + self.cfg.averaging.barrier_timeout_s
        while True:
            others = self._others()
            if any(r.round > self.round and r.state != "loading" for r in others.values()):
                before = self.round
                self.catch_up()
                if self.round != before:
                    return None
            # Peers still loading at our round will train it too: wait for them as for any other.
            same = [r for r in others.values() if r.round == self.round and r.state != "done"]
            ready = [r for r in same if r.state == "averaging"]
            if len(ready) == len(same):
                break
            if time.monotonic() > deadline:
                log.warning(
                    "barrier timeout: averaging without slow peers",
                    round=self.round,
                    ready=len(ready),
                    waiting_for=[r.peer_id[-8:] for r in same if r.state != "averaging"],
                )
                break
            if self.stop.wait(self._poll_s):
                return None  # stopping: leave the round unfinished rather than step alone
        mine = self.diloco.params_hash()
        canon = canonical_hash([*ready, self._own_record(mine)])
        if canon != mine:
            donors = [r.peer_id for r in ready if r.params_hash == canon]
            log.warning(
                "params differ from the swarm's; rebasing onto them", round=self.round, ours=mine, swarm=canon
            )
            self.load_state_from(donors, rebase=True, expect_round=self.round)
        return ready

    def outer_sync(self, peers: list[ProgressRecord], stats: RoundStats) -> OuterStepReport:
        """Average pseudo-gradients with ``peers`` (weighted by samples) and take the outer step."""
        assert self.swarm is not None
        t0 = time.monotonic()
        alone = len(peers) + 1 < max(self.cfg.averaging.min_group_size, 2)
        report = self.diloco.sync(
            None if alone else self.averager,
            weight=max(stats.samples, 1),
            round=self.round,
            fallback=self._step_alone_after_failure,
        )
        report_duration = time.monotonic() - t0
        self.swarm.update(
            round=self.round,
            state="training",
            params_hash=self.diloco.params_hash(),
            last_group_size=report.group_size,
            samples_round=0,
        )
        assert self.averager is not None
        self.averager.set_round(self.round)
        self._last_sync_s = report_duration
        return report

    def _step_alone_after_failure(self) -> bool:
        """Averaging failed: step with our own pseudo-gradient, unless the swarm has already moved past
        this round (then our step would fork the params; the next catch-up loads the swarm's instead)."""
        ahead = [r for r in self._others().values() if r.round > self.round and r.state != "loading"]
        if ahead:
            log.warning("averaging failed and the swarm moved on; will load its state", round=self.round)
        return not ahead

    def log_round(self, report: OuterStepReport, stats: RoundStats) -> None:
        if report.failure == "non_finite":
            log.warning(
                "pseudo-gradient has NaN or Inf: not sent, this round's local work dropped, state kept",
                round=report.round,
            )
        duration = time.monotonic() - stats.started  # the round itself, before this peer's evaluation
        val_loss = self.evaluate()
        self.val_losses.append((self.round, val_loss))
        if report.applied:
            telemetry.OUTER_STEPS.inc()
        if report.failure in telemetry.FAILURE_REASONS:
            telemetry.OUTER_STEP_FAILURES.labels(reason=report.failure).inc()
        telemetry.OUTER_STEP_DURATION.observe(duration)
        telemetry.SYNC_DURATION.observe(self._last_sync_s)
        telemetry.AVERAGING_SENT.inc(report.bytes_sent)
        telemetry.AVERAGING_RECEIVED.inc(report.bytes_received)
        telemetry.GROUP_SIZE.set(report.group_size)
        telemetry.VALIDATION_LOSS.set(val_loss)
        telemetry.ROUND.set(self.round)
        # The canonical line: one per outer step, everything a person or a log pipeline needs about the round.
        log.info(
            "outer step",
            round=report.round,
            train_loss=round(stats.loss, 4),
            val_loss=round(val_loss, 4),
            samples=stats.samples,
            group_size=report.group_size,
            fallback=report.failure,
            bytes_sent=report.bytes_sent,
            bytes_received=report.bytes_received,
            delta_norm=round(report.delta_norm, 4),
            duration_s=round(duration, 2),
            inner_s=round(stats.inner_s, 2),
            sync_s=round(self._last_sync_s, 2),
        )

    def maybe_checkpoint(self) -> None:
        every = self.cfg.checkpoint.every_rounds
        if every and self.round % every == 0:
            self.save(self.checkpoint_dir / f"round-{self.round:06d}.safetensors")
            checkpoint.prune(self.checkpoint_dir, self.cfg.checkpoint.keep_last)

    def resume_from_checkpoint(self) -> None:
        """Continue from the newest valid checkpoint of this experiment in checkpoint.dir, if any.

        A file that is corrupted, truncated or of another config is refused with a warning and the next
        newest is tried: a bad file is never loaded silently, and a good older one is not ignored.
        """
        for path in checkpoint.candidates(self.checkpoint_dir):
            try:
                state = checkpoint.load_state(self.model, path, self.cfg.training_hash())
                self.diloco.load_state_tensors(state.outer, round=state.round)
                state.load_inner_into(self.inner_opt)
            except (checkpoint.CheckpointError, ValueError) as e:
                log.warning("refused a checkpoint", path=str(path), reason=str(e))
                continue
            if state.residuals and self.diloco.error_feedback is not None:
                self.diloco.error_feedback.residuals = [r.clone() for r in state.residuals]
            self.inner_steps_total = state.counters.get("inner_steps_total", 0)
            self.samples_total = state.counters.get("samples_total", 0)
            log.info(
                "resumed from checkpoint",
                path=str(path),
                round=state.round,
                inner_optimizer=bool(state.inner),
                inner_steps_total=self.inner_steps_total,
            )
            return

    def finish(self) -> None:
        """Write the final model, then linger so that slower peers can finish and compare with us."""
        assert self.swarm is not None
        self.final_path = self.checkpoint_dir / "final.safetensors"
        self.save(self.final_path, final=True)
        self.swarm.update(state="done", params_hash=self.diloco.params_hash())
        deadline = time.monotonic() + self.cfg.swarm.linger_s
        while time.monotonic() < deadline and not self.stop.is_set():
            others = self._others()
            done = [r for r in others.values() if r.state == "done" and r.round == self.round]
            canon = canonical_hash([*done, self._own_record(self.diloco.params_hash())])
            if canon != self.diloco.params_hash():
                donors = [r.peer_id for r in done if r.params_hash == canon]
                log.warning(
                    "final params differ from the swarm's; adopting them", ours=self.diloco.params_hash()
                )
                if self.load_state_from(donors, rebase=False, expect_round=self.round):
                    self.save(self.final_path, final=True)
                    self.swarm.update(params_hash=self.diloco.params_hash())
            if all(r.state == "done" for r in others.values()):
                break
            self.stop.wait(self.cfg.swarm.heartbeat_s)
        log.info(
            "finished", round=self.round, path=str(self.final_path), params_hash=self.diloco.params_hash()
        )

    def shutdown(self) -> None:
        """Stop the averager, the heartbeat, the DHT child and p2pd. Safe to call twice."""
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None
        if self.swarm is not None:
            self.swarm.shutdown()
            self.swarm = None

    # --------------------------------------------------------------------------------- helpers

    @property
    def _poll_s(self) -> float:
        # Reading the swarm's records fetches every peer's signed record from several DHT nodes (~1 KB
        # each): poll no faster than records can change.
        return self.cfg.swarm.heartbeat_s / 2

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.cfg.checkpoint.dir)

    def _others(self) -> dict[str, ProgressRecord]:
        assert self.swarm is not None
        return {pid: r for pid, r in self.swarm.peers().items() if pid != self.peer_id}

    def _own_record(self, params_hash: str) -> ProgressRecord:
        return ProgressRecord(
            peer_id=self.peer_id,
            round=self.round,
            state="averaging",
            params_hash=params_hash,
            samples_round=0,
            samples_total=self.samples_total,
            samples_per_s=0.0,
            last_group_size=self.swarm.status.last_group_size if self.swarm else 0,
            device=self.device.type,
            time=time.time(),
        )

    def _rank_in_round(self) -> tuple[int, int]:
        """Our place in this round's roster (sorted peer ids of the live peers of our round)."""
        roster = {pid for pid, r in self._others().items() if r.round == self.round and r.state != "loading"}
        roster.add(self.peer_id)
        ordered = sorted(roster)
        return ordered.index(self.peer_id), len(ordered)

    def _inner_lr(self) -> float:
        warmup = self.cfg.inner.warmup_steps
        if warmup and self.inner_steps_total < warmup:
            return self.cfg.inner.lr * (self.inner_steps_total + 1) / warmup
        return self.cfg.inner.lr

    def _state_for_donation(self) -> tuple[dict, list[torch.Tensor]]:
        """What a newcomer downloads from us: global params, outer momentum, round (a consistent snapshot)."""
        snap = self.diloco.snapshot()
        tensors = snap.params + snap.momentum
        metadata = dict(
            run_id=self.cfg.run.run_id,
            config_hash=self.cfg.training_hash(),
            round=snap.round,
            params_hash=tensors_hash(snap.params),
            state_hash=tensors_hash(tensors),
        )
        return metadata, tensors

    def load_state_from(self, donors: list[str], *, rebase: bool, expect_round: int | None = None) -> bool:
        """Download and verify a donor's state, then adopt it.

        Args:
            donors: peer ids to try, in order; a donor that fails or sends a bad state is skipped.
            rebase: keep our inner progress (our pseudo-gradient) on top of the new params; otherwise the
                model restarts from the downloaded params.
            expect_round: refuse states of other rounds.
        """
        assert self.averager is not None
        remaining = list(donors)
        while remaining:
            got = self.averager.download_state(remaining, timeout=self.cfg.swarm.state_download_timeout_s)
            if got is None:
                return False
            donor, meta, tensors = got
            remaining = remaining[remaining.index(donor) + 1 :]
            problem = self._check_state(meta, tensors, expect_round)
            if problem:
                log.warning("refused a state", donor=donor[-8:], reason=problem)
                continue
            delta = self.diloco.pseudo_gradient() if rebase else None
            self.diloco.load_state_tensors(tensors, round=meta["round"])
            if delta is not None:
                self.diloco.rebase(delta)
            assert self.swarm is not None
            self.swarm.update(round=self.round, params_hash=self.diloco.params_hash())
            self.averager.set_round(self.round)
            telemetry.STATE_LOADS.inc()
            telemetry.ROUND.set(self.round)
            log.info("loaded state", donor=donor[-8:], round=self.round, params_hash=meta["params_hash"])
            return True
        return False

    def _check_state(self, meta, tensors: list[torch.Tensor], expect_round: int | None) -> str | None:
        if not isinstance(meta, dict) or not {"run_id", "config_hash", "round", "state_hash"} <= meta.keys():
            return "malformed metadata"
        if meta["run_id"] != self.cfg.run.run_id:
            return f"run_id {meta['run_id']!r}"
        if meta["config_hash"] != self.cfg.training_hash():
            return "the donor trains a different experiment config (run, model, data, inner or outer differ)"
        if expect_round is not None and meta["round"] != expect_round:
            return f"round {meta['round']}, expected {expect_round}"
        if tensors_hash(tensors) != meta["state_hash"]:
            return "checksum mismatch"
        return None

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss of the current global params (the model holds them right after a sync)."""
        return evaluate(self.model, self.corpus, self.cfg, self.device)["val_loss"]

    def save(self, path: Path, *, final: bool = False) -> None:
        """Checkpoint; a final model file leaves out the inner optimizer (2x the params, useless after the end)."""
        checkpoint.save(
            path,
            self.model,
            self.diloco,
            self.cfg,
            peer_id=self.peer_id,
            inner_optimizer=None if final else self.inner_opt,
            counters={"inner_steps_total": self.inner_steps_total, "samples_total": self.samples_total},
        )


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, cfg: ExperimentConfig, device: torch.device) -> dict:
    """Validation loss, perplexity and next-byte accuracy over ``data.eval_batches`` fixed batches."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in corpus.val_batches(cfg.inner.batch_size, cfg.data.eval_batches):
        x, y = x.to(device), y.to(device)
        logits = model(x).float()
        loss_sum += float(F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        count += y.numel()
    model.train(was_training)
    val_loss = loss_sum / count
    return {
        "val_loss": val_loss,
        "perplexity": math.exp(val_loss),
        "accuracy": correct / count,
        "tokens": count,
    }
