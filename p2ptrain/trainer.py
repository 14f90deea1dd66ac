"""One peer's training loop: inner steps, then an outer sync with the swarm, round after round.

Read :meth:`Trainer.run` top to bottom; every phase is a method below it, in the order it runs. The
decisions a phase takes about the swarm (catch up? wait? rebase? step alone? leave?) are pure functions
in ``protocol.py``; this module gathers their inputs and carries them out.

The network sits behind a :class:`Link`: a records board and an averager. :func:`connect_hivemind` builds
the real ones (a DHT child with ``p2pd``, an averager child); tests pass an in-memory swarm instead, so
that the whole round protocol runs in one process.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

import torch

from p2ptrain import checkpoint, experiment, protocol, telemetry, verify
from p2ptrain.compression import ErrorFeedback, codec_for, layout_for, wire_parts
from p2ptrain.config import ConfigError, ExperimentConfig
from p2ptrain.data import open_corpus
from p2ptrain.diloco import DiLoCo, OuterStepReport, tensors_hash
from p2ptrain.evaluation import evaluate
from p2ptrain.inner import (
    benchmark_device,
    inner_lr,
    inner_step,
    make_optimizer,
    pick_device,
    replica_steps,
    round_warmup,
)
from p2ptrain.link import Connect, Link, connect_hivemind
from p2ptrain.logs import bind, get_logger
from p2ptrain.models import build_model, num_params
from p2ptrain.progress import InnerProgress, Waiting, terminal_progress_enabled
from p2ptrain.protocol import BarrierState, BehindState, LingerState, Me
from p2ptrain.records import MAX_LISTED, MAX_WIRE_PARTS, PeerState, ProgressRecord, live
from p2ptrain.schedule import Machine, Probe, Schedule, memory_problem, own_memory_bytes
from p2ptrain.transfer import donation, fetch_state

log = get_logger(__name__)


# ------------------------------------------------------------------------------------------- outcomes


class Outcome(str, Enum):
    FINAL = "final"
    """Finished holding the swarm's final params: ``final.safetensors``."""
    INTERRUPTED = "interrupted"
    """Stopped (a signal, a test) before the end: ``interrupted.safetensors``, to resume from."""
    STRANDED = "stranded"
    """Behind the swarm and unable to get its state: ``interrupted.safetensors`` (its own, older state)."""
    DIVERGED = "diverged"
    """Finished with params other than the swarm's final ones and could not adopt them:
    ``diverged.safetensors``."""


FILE_NAMES = {
    Outcome.FINAL: "final.safetensors",
    Outcome.INTERRUPTED: "interrupted.safetensors",
    Outcome.STRANDED: "interrupted.safetensors",
    Outcome.DIVERGED: "diverged.safetensors",
}


@dataclass
class RunResult:
    outcome: Outcome
    path: Path | None
    """The model file written (None if the peer stopped before it had any state worth keeping)."""
    reason: str = ""
    """For people: why the peer ended this way."""

    @property
    def ok(self) -> bool:
        """Whether the process should exit 0: the swarm's final model, or a stop that was asked for."""
        return self.outcome in (Outcome.FINAL, Outcome.INTERRUPTED)


STEP_OF_MATCHMAKING = 0.25
"""Training on past H (``inner.max_steps_while_waiting``) takes no step longer than this share of
``averaging.matchmaking_time_s``: a peer that trains on joins its group up to a step after the last peer is
done, well inside the time the group's leader waits for its members."""

BARRIER_POLL_S = 0.05
"""The longest the barrier goes without reading the records (or half a heartbeat, if that is shorter). A push
that lands in the DHT child's table wakes it at once (``Board.wait_for_news``): the round's peers leave it as
the last one's push arrives. A read asks that table (``board.py``), not the network."""

CLAIM_POLL_START_S = 0.05
"""The first wait between reads of a verifiable round's claims (doubling up to half a heartbeat)."""

REALIGN_TRIES = 2
"""The most donors a realignment of our reputation asks in one round (each may take up to
swarm.state_download_timeout_s, while our round waits); the next round tries again."""


@dataclass
class RoundStats:
    loss_sum: float = 0.0
    steps: int = 0
    samples: int = 0
    started: float = field(default_factory=time.monotonic)
    inner_s: float = 0.0
    barrier_s: float = 0.0
    verify_s: float = 0.0
    sync_s: float = 0.0
    eval_s: float = 0.0
    paused: bool = False
    """The schedule paused us before the inner phase ended: its steps are dropped."""
    dropped: bool = False
    """The previous round's sync (overlap) failed while we trained, and we may not step alone (the swarm went
    on without us): these steps are dropped."""
    shard: str = ""
    """The data shard the inner phase trained, ``rank/world`` (the outer step's log line says it)."""
    weight: float | None = None
    """A verifiable round's weight for us, as the verdict gives it (a full inner phase's samples over our
    replica group's size): we send exactly that (reducers refuse any other)."""
    steps_while_waiting: int = 0
    """Steps past H taken while the round's slower peers finished theirs (``inner.max_steps_while_waiting``)."""

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.steps, 1)

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Add the block's wall time to ``<phase>_s`` (the round's log line and the phase metric report them)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            setattr(self, f"{phase}_s", getattr(self, f"{phase}_s") + time.monotonic() - t0)


class _Background:
    """A round's sync in a daemon thread (``outer.overlap``): first the all-reduce and outer step (:meth:`synced`
    once they are over: the result can land), then the round's evaluation and log line, which
    need not hold up the landing. :meth:`result` and :meth:`finish` hand on what each part raised. A round
    evaluated in the background (``device.evaluate_in_background``) runs as one whose sync is already done:
    its ``sync`` returns the report at once."""

    def __init__(
        self,
        sync: Callable[[RoundStats], OuterStepReport | None],
        after: Callable[[OuterStepReport, RoundStats], None],
        stats: RoundStats,
        *,
        round: int,
        steps: int,
    ):
        self.round = round
        self.steps = steps
        """The inner steps the peer had taken when the sync began."""
        self._error: BaseException | None = None
        self._after_error: BaseException | None = None
        self._synced = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(sync, after, stats), name=f"sync-{round}", daemon=True
        )

    def start(self) -> _Background:
        self._thread.start()
        return self

    def _run(self, sync, after, stats: RoundStats) -> None:
        try:
            report = sync(stats)
        except BaseException as e:  # an injected crash too: the training thread re-raises it
            self._error, report = e, None
        finally:
            self._synced.set()
        if report is None:
            return
        try:
            after(report, stats)
        except BaseException as e:
            self._after_error = e

    def synced(self) -> bool:
        return self._synced.is_set()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def wait_synced(self) -> None:
        """Wait for the outer step (not the evaluation)."""
        self._synced.wait()

    def result(self) -> None:
        """Raise what the sync raised (after :meth:`wait_synced`)."""
        self._synced.wait()
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Wait for the evaluation and log line too; raise what they raised."""
        self._thread.join()
        if self._after_error is not None:
            raise self._after_error


class Trainer:
    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        stop: threading.Event | None = None,
        on_started: Callable[[list[str]], None] | None = None,
        connect: Connect = connect_hivemind,
        machine: Probe | None = None,
    ):
        """
        Args:
            cfg: the resolved experiment config.
            stop: set it (from a signal handler, a test) to stop cleanly at the next safe point.
            on_started: called with this peer's multiaddrs once it is in the swarm.
            connect: builds the network parts (tests pass an in-memory swarm's).
            machine: what the schedule reads (``schedule.Machine``, psutil; tests pass their own).
        """
        self.cfg = cfg
        self.stop = stop or threading.Event()
        self.on_started = on_started
        self.connect = connect
        self.link: Link | None = None
        self.schedule = Schedule(cfg.schedule, machine or Machine()) if cfg.schedule.enabled else None
        """When the volunteer's machine lets us train (``schedule:``); None: always."""
        self.benchmark_samples_per_s = self.benchmark_flops = 0.0
        """Our device's speed at the run's model (``device.benchmark_steps``; 0: not measured)."""
        self.stop_reason = "stopped"
        """Why the run stopped before its end (a signal, or the memory cap)."""
        self.pauses: list[tuple[int, str]] = []
        """Every pause: (the round we were in, why)."""
        self.peer_dir: checkpoint.PeerDir | None = None
        """This peer's checkpoint directory, held while it runs (``checkpoint.dir``)."""
        self.overlapping = cfg.outer.overlap and cfg.verification.replicas == 1
        """Each round's sync runs in the background while the next round trains (``outer.overlap``)."""
        self._sync: _Background | None = None
        """The round whose sync is in flight (overlap), until it lands."""
        self._evaluating: _Background | None = None
        """A round whose evaluation and log line may still be running: a landed sync (overlap), or a round
        evaluated behind the next one (``device.evaluate_in_background``)."""
        self.overlapped: list[tuple[int, int]] = []
        """Every overlapped sync as it landed: (its round, the inner steps of the next round taken meanwhile)."""
        self._eval_model: torch.nn.Module | None = None
        """With overlap or ``device.evaluate_in_background``: a copy of the model that evaluates the master
        params while the model trains."""
        self._next_deadline: float | None = None
        """With ``inner.round_seconds``: when the next inner phase ends (set as we leave a barrier)."""
        self.maddrs: list[str] = []
        self.val_losses: list[tuple[int, float]] = []
        self.rounds_voided: list[int] = []
        """Verifiable rounds in which nobody's work was verified (the round passed, params unchanged)."""
        self.rounds_applied: list[int] = []
        """Every round whose outer step this peer applied, in order (tests check none is applied twice)."""
        self.loads: list[tuple[str, int]] = []
        """Every state this peer loaded from another: (why, the round it got)."""
        self.refusals: list[tuple[str, str]] = []
        """Every donor whose state this peer asked for and did not load: (donor, why)."""
        self.resumed_round: int | None = None
        """The round of the checkpoint this peer resumed from, if it did."""
        self.memory = protocol.SwarmMemory(cfg.outer.num_rounds)
        """What this peer has seen of the swarm (kept in its checkpoints)."""
        self.backoff = protocol.DonorBackoff(base_s=cfg.swarm.heartbeat_s, max_s=cfg.swarm.record_ttl_s)
        self.last_group_size = 0
        v = cfg.verification
        self.verifying = v.replicas > 1
        """Verifiable rounds: replicas of a shard compare sketches of their work (verify.py)."""
        self.reputation = verify.Reputation(
            rounds_to_trust=v.rounds_to_trust, strikes_to_ban=v.strikes_to_ban, window=v.strike_window_rounds
        )
        """Trust and bans from verdicts; part of the state (donated, checkpointed), so the swarm shares one."""
        self._reputation_at_step: dict = self.reputation.to_dict()
        """The reputation as of our last round change: what we donate along with that round's state."""
        self._reputation_backed = True
        """Whether our reputation is the swarm's as far as we know: false after we kept ours when the swarm's
        records backed no donor's (our record then carries no digest of it: it gets no say in newcomers')."""
        self.verdicts: list[tuple[int, verify.RoundVerdict]] = []
        """Every verifiable round's verdict this peer reached, in order."""
        self._replicas: tuple[str, ...] = ()
        self._shard = ""
        self.disputes: list[verify.Dispute] = []
        """Dissenting replica groups whose referee has not reported yet."""
        self._referee_jobs: list[tuple[verify.Dispute, list[torch.Tensor]]] = []
        self._my_referee_report: tuple[int, tuple[str, ...], torch.Tensor] | None = None
        self._digest = self._nonce = ""
        self._assigned_over: tuple[int, verify.Roster, frozenset[str]] = (0, (), frozenset())
        """Our assignment's seed, its roster (each member with the class we read), and whom the swarm's
        reputation trusted then (before this round's referees' strikes)."""
        self.refused: set[str] = set()
        """Peers our averager left out for good (``AverageResult.refused``): ignored like banned ones."""
        self._wire: verify.Wire | None = None
        """Our pseudo-gradient as the all-reduce will send it: what we seal, sketch and send."""

    @property
    def round(self) -> int:
        return self.diloco.round

    # ---------------------------------------------------------------------------------- the loop

    def run(self) -> RunResult:
        """Train until ``outer.num_rounds``, a stop request, or the swarm leaves us behind for good."""
        try:
            self.setup()
            if self.on_started is not None:
                self.on_started(self.maddrs)
            self.join_swarm()
            stranded = None
            while not self.stop.is_set():
                self.pause_while_asked()  # the volunteer's machine comes first
                if self.stop.is_set():
                    break
                if self._sync is None:
                    stranded = self.catch_up()  # may jump several rounds, up to the end of the run
                    if stranded is not None or self.round >= self.cfg.outer.num_rounds:
                        break
                elif self._sync.round + 1 >= self.cfg.outer.num_rounds:
                    self.land()  # the last round's sync: no round left to train meanwhile
                    continue
                bind(round=self.training_round)
                self.referee()  # a dissent we were drawn to settle: recompute its shard first
                stats = self.inner_phase()  # with a sync in flight, takes its result in when it lands
                if self.stop.is_set():
                    break
                if not self.land() or stats.dropped:  # the previous round's sync failed: we catch up
                    continue
                if stats.paused:  # cut short by the schedule: the round goes on without us
                    continue
                if self.verifying:
                    self.seal()
                if self.overlapping:  # the last round's evaluation copies the master params: before a rebase
                    self._finish_evaluation()
                with stats.timing("barrier"):
                    group = self.barrier()
                if group is None:  # the swarm moved on while we trained (our work is stale), or a stop
                    continue
                if self.overlapping:  # the round's all-reduce and outer step run while the next round trains
                    self.diloco.detach()
                    self._sync = _Background(
                        functools.partial(self.outer_sync, group),
                        self.log_round,
                        stats,
                        round=self.round,
                        steps=self.inner_steps_total,
                    )
                    self._sync.start()  # once it is ours to see: its waits show no spinner
                    continue
                if self.verifying:
                    with stats.timing("verify"):
                        group = self.verify_round(group, stats)
                    if group is None:  # our replica group was left out: the round's result comes from others
                        continue
                report = self.outer_sync(group, stats)
                self.log_round(report, stats, behind=self.evaluates_behind)
                self.end_round()
            self.land()
            self._finish_evaluation()
            if stranded is not None:
                return self.end_stranded(stranded)
            if self.round >= self.cfg.outer.num_rounds:
                return self.finish()
            return RunResult(Outcome.INTERRUPTED, self.save(Outcome.INTERRUPTED), self.stop_reason)
        finally:
            for background in (self._sync, self._evaluating):
                if (
                    background is not None and not background.done()
                ):  # we are failing: end its waits, then stop
                    self.stop.set()
                    background.join(timeout=self.cfg.swarm.heartbeat_s * 4)
            self.shutdown()

    @property
    def training_round(self) -> int:
        """The round the model trains: ours, or, while ours is averaged in the background, the next one."""
        return self._sync.round + 1 if self._sync is not None else self.round

    def land(self) -> bool:
        """Wait for the outer step of the round's sync in flight, if any, and take its result into the model,
        in this thread: the inner progress made since carries over onto the new params, or is dropped if the
        sync failed and we may not step alone (returns False; the loop then catches up). Then what ends a round:
        checkpoint, memory. The round's evaluation may still be running (:meth:`_finish_evaluation`)."""
        if self._sync is None:
            return True
        sync, self._sync = self._sync, None
        sync.wait_synced()
        kept = self.diloco.land()
        stale = self.inner_steps_total - sync.steps
        self.overlapped.append((sync.round, stale))
        sync.result()  # its exception, if it failed (a crash, a bug): ours
        telemetry.observe_stale_steps(stale)
        self.log.info("sync landed", round=sync.round, stale_steps=stale, kept=kept)
        self._finish_evaluation()  # the one before (done by now: a sync starts after it)
        self._evaluating = sync
        self.end_round()
        return kept

    def _finish_evaluation(self) -> None:
        """Wait for the evaluation and log line of a round behind us (a landed sync's with overlap, or one
        evaluated in the background): one at a time, in order."""
        if self._evaluating is not None:
            evaluating, self._evaluating = self._evaluating, None
            evaluating.finish()

    def end_round(self) -> None:
        self.maybe_checkpoint()
        self.check_memory()

    # ------------------------------------------------------------------------------ the phases

    def setup(self) -> None:
        cfg = self.cfg
        # First: a peer that would write into another running peer's directory must not start anything.
        self.peer_dir = checkpoint.PeerDir.claim(cfg.checkpoint.dir, cfg.run.run_id)
        self.device = pick_device(cfg.device.kind)
        self.corpus = open_corpus(cfg.data, cfg.model.context_length, cfg.data.val_fraction)
        # On the CPU until the network's children have forked: they must not inherit a CUDA context.
        self.model = build_model(
            cfg.model.name,
            cfg.model.context_length,
            cfg.model.dropout,
            seed=cfg.run.seed,
            **self.corpus.model_args(),
        )
        self.codec = codec_for(cfg.averaging)  # error feedback rounds each tensor as the wire does
        shapes = [p.shape for p in self.model.parameters() if p.requires_grad]
        # Packed or not, the wire carries exactly what self.codec rounds each tensor to (compression.Layout).
        self.layout = layout_for(shapes, cfg.averaging)
        if self.verifying:
            metas = [torch.empty(s, device="meta") for s in self.layout.wire_shapes]
            parts = len(wire_parts(metas, self.layout.codec, self.layout.part_size_bytes))
            if parts > MAX_WIRE_PARTS:
                raise ConfigError(
                    f"verification.replicas {cfg.verification.replicas}: model {cfg.model.name} goes into the "
                    f"all-reduce in {parts} parts, and a verifiable round binds {MAX_WIRE_PARTS} at most"
                )
        error_feedback = ErrorFeedback(self.codec, shapes) if cfg.averaging.error_feedback else None
        # torch's MPS backend crashes when two threads use it at once (pytorch/pytorch#197805): there, evaluation
        # stays in the training thread, and overlap's copy (its sync thread evaluates) stays on the CPU.
        self.evaluates_behind = cfg.device.evaluate_in_background and self.device.type != "mps"
        self._eval_device = torch.device("cpu") if self.device.type == "mps" else self.device
        if self.overlapping or self.evaluates_behind:
            self._eval_model = copy.deepcopy(self.model)  # evaluates the master params while the model trains
        self.diloco = DiLoCo(
            self.model,
            lr=cfg.outer.lr,
            momentum=cfg.outer.momentum,
            nesterov=cfg.outer.nesterov,
            error_feedback=error_feedback,
            carry=cfg.outer.overlap_carry,
        )
        self.link = self.connect(
            cfg,
            device=self.device.type,
            layout=self.layout,
            state_provider=self._donation,
            stop=self.stop,
        )
        self.board, self.averager = self.link.board, self.link.averager
        self.board.subscribe(self._remember)
        self.peer_id = self.board.peer_id
        self.log = log.bind(peer_id=self.peer_id[-8:])
        bind(peer_id=self.peer_id[-8:])
        self.maddrs = self.board.visible_maddrs()
        # Only now, after the averager child has forked: torch.set_num_threads creates a thread pool that a
        # forked child inherits broken, and the child's first parallel op in a new thread then fails with
        # "Invalid thread pool!" (its all-reduce stalls until groupmates time it out).
        if cfg.device.num_threads:
            torch.set_num_threads(cfg.device.num_threads)
        self.model.to(self.device)
        if self._eval_model is not None:
            self._eval_model.to(self._eval_device)
        self.inner_opt = make_optimizer(self.diloco.model_params, cfg.inner)
        self.inner_steps_total = 0
        self.samples_total = 0
        self.compute_s = 0.0
        """Seconds spent in inner phases of this run (restored from checkpoints)."""
        self.rounds_contributed = 0
        """Rounds whose outer step we applied with our own pseudo-gradient (restored from checkpoints)."""
        if cfg.device.max_memory_gb is not None:
            self.cap_accelerator_memory(cfg.device.max_memory_gb)
        if cfg.device.benchmark_steps:
            self.benchmark_device()
        # After the benchmark's step (the inner phase's peak: activations, gradients, AdamW state): a peer
        # that cannot train under its volunteer's cap says so before it joins any round.
        if problem := self._memory_problem("after one inner step"):
            raise ConfigError(problem)
        if cfg.checkpoint.resume:
            self.resume_from_checkpoint()
        if cfg.metrics.port:  # after the forks: a child must not inherit the listening socket
            telemetry.serve(cfg.metrics.port, cfg.metrics.host)
        telemetry.set_peer_info(
            peer_id=self.peer_id, run_id=cfg.run.run_id, device=self.device.type, model=cfg.model.name
        )
        telemetry.ROUND.set(self.round)
        self.log.info(
            "peer started",
            run_id=cfg.run.run_id,
            device=str(self.device),
            model=cfg.model.name,
            params=num_params(self.model),
            round=self.round,
            maddrs=self.maddrs,
            config_hash=cfg.training_hash(),
        )
        self.agree_on_experiment()

    def cap_accelerator_memory(self, cap_gb: float) -> None:
        """Hold CUDA's or MPS's allocator to the volunteer's cap (on the CPU, :meth:`check_memory` watches)."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * 2**30 / total), self.device)
        elif self.device.type == "mps":
            torch.mps.set_per_process_memory_fraction(
                min(1.0, cap_gb * 2**30 / torch.mps.recommended_max_memory())
            )

    def check_memory(self) -> None:
        """Over ``device.max_memory_gb`` after a round: stop cleanly (our state is saved) and say why."""
        if problem := self._memory_problem(f"after round {self.round - 1}"):
            self.log.error("over the memory cap: stopping", problem=problem)
            self.stop_reason = problem
            self.stop.set()

    def _memory_problem(self, when: str) -> str | None:
        cap = self.cfg.device.max_memory_gb
        return None if cap is None else memory_problem(cap, own_memory_bytes(), when)

    def benchmark_device(self) -> None:
        """Time a few inner steps of the run's model on a copy of it: our device's speed, for the swarm to see."""
        cfg = self.cfg
        samples_per_s, flops = benchmark_device(
            self.model,
            cfg.inner,
            batch=self.corpus.example_batch(cfg.inner.batch_size),
            steps=cfg.device.benchmark_steps,
            autocast_dtype=getattr(torch, cfg.device.dtype),
        )
        self.benchmark_samples_per_s, self.benchmark_flops = samples_per_s, flops  # published as we join
        telemetry.observe_benchmark(samples_per_s, flops)
        self.log.info(
            "device benchmark",
            device=str(self.device),
            samples_per_s=round(samples_per_s, 1),
            gflops=round(flops / 1e9, 2),
        )

    def agree_on_experiment(self) -> None:
        """Train the swarm's experiment or nothing: refuse a config whose training sections differ from the
        one the swarm publishes for our run_id; publish ours if it has none (we start the run). Then carry
        it, so that it outlives whoever published it.

        Raises:
            ConfigError: our training sections differ from the swarm's (the message names the fields).
        """
        published = experiment.choose(self.board.experiments(), self.cfg.run.run_id)
        if published is None:
            record = self.board.sign_experiment(self.cfg)
            self.log.info("published the run's experiment", run_id=self.cfg.run.run_id)
        else:
            experiment.check(self.cfg, published)
            record = published.record
            self.log.info(
                "the swarm's experiment is ours",
                run_id=published.run_id,
                owner=published.owner[-8:],
                carried_by=len(published.publishers),
            )
        self.board.carry_experiment(record)

    def join_swarm(self) -> None:
        """Publish ourselves, and wait for the swarm's records (and ``swarm.min_peers``) to show up."""
        cfg = self.cfg.swarm
        self.board.update(
            round=self.round,
            state=PeerState.LOADING,
            params_hash=self.diloco.params_hash(),
            numeric_class=self.numeric_class,
            # Who we are as a contributor: our device's speed, and what we gave the run before a restart.
            benchmark_samples_per_s=self.benchmark_samples_per_s,
            benchmark_flops=self.benchmark_flops,
            samples_total=self.samples_total,
            compute_s=self.compute_s,
            rounds_contributed=self.rounds_contributed,
            **self._reputation_as_of_step(),
        )
        self.board.start()
        if cfg.initial_peers or cfg.initial_peers_file:
            # Records take a moment to reach a new DHT node; give the swarm two heartbeats to show up.
            deadline = time.monotonic() + 2 * cfg.heartbeat_s + 1
            while time.monotonic() < deadline and not self._others() and not self.stop.is_set():
                time.sleep(self._poll_s)
        if cfg.min_peers > 1:
            deadline = time.monotonic() + cfg.min_peers_timeout_s
            self.log.info("waiting for peers", min_peers=cfg.min_peers)
            with self._waiting() as waiting:
                while (present := len(live(self._others())) + 1) < cfg.min_peers:
                    if time.monotonic() > deadline:
                        self.log.warning(
                            "starting without swarm.min_peers", min_peers=cfg.min_peers, present=present
                        )
                        break
                    waiting.update("waiting for peers", present=present, min_peers=cfg.min_peers)
                    if self.stop.wait(self._poll_s):
                        break
        # Our first decisions (catch up or train, the roster, the barrier) must not come from a reading of
        # the swarm mid-outer-step, where no peer ahead is credible: wait for one that settles, at most one
        # record lifetime (a dead peer's record is gone by then, and a lone liar costs us that, once).
        if protocol.unsettled(self.me(), self._others()):
            self.log.info("the swarm's records disagree on its round; waiting for them to settle")
            deadline = time.monotonic() + cfg.record_ttl_s
            while protocol.unsettled(self.me(), self._others()):
                if time.monotonic() > deadline:
                    self.log.warning(
                        "the swarm's records did not settle; going on without the claims nobody vouches for",
                        waited_s=cfg.record_ttl_s,
                    )
                    break
                if self.stop.wait(self._poll_s):
                    break

    def pause_while_asked(self) -> None:
        """While the schedule says so (the machine is busy, on battery, or outside its hours), sit out as
        ``paused``: nobody waits for us at a barrier or counts us in a round. Then come back as a peer that
        may have fallen behind: the loop catches up with the swarm before it trains."""
        if self.schedule is None or (reason := self.schedule.check()) is None:
            return
        self.land()  # a round's sync in flight ends first (the swarm counts on it)
        started = time.monotonic()
        self.pauses.append((self.round, reason))
        self.diloco.reset_model()  # an inner phase cut short: its steps are dropped
        self.board.update(state=PeerState.PAUSED, samples_round=0, **self._no_claims())
        telemetry.PAUSED.set(1)
        self.log.info(
            "paused: the machine comes first",
            reason=reason,
            round=self.round,
            resumes_once_free_for_s=round(self.schedule.wait_s, 1),
        )
        with self._waiting() as waiting:
            while not self.stop.is_set() and (reason := self.schedule.check()) is not None:
                waiting.update(f"round {self.round}: paused", reason=reason)
                self.stop.wait(min(self.cfg.schedule.check_every_s, self._poll_s))
        telemetry.PAUSED.set(0)
        self._next_deadline = None  # the group we left did not wait for us
        self.board.update(state=PeerState.LOADING)  # until we know where the swarm is
        self.log.info("resumed", round=self.round, paused_s=round(time.monotonic() - started, 1))

    def catch_up(self) -> protocol.Stranded | None:
        """While the swarm is past our round, load its state; never train a round it has left behind.

        Returns None when we may train (we are at the swarm's round, or we gave up on peers one round ahead
        that could not give us theirs), or why we must stop (see :func:`protocol.behind`).
        """
        loading = False
        with self._waiting() as waiting:
            while not self.stop.is_set():
                now = time.monotonic()
                decision = protocol.behind(
                    self.me(),
                    self._visible(),
                    self.memory,
                    now=now,
                    resting=self.backoff.resting(now),
                    timeout_s=self.cfg.swarm.catch_up_timeout_s,
                )
                if decision.state == BehindState.STRANDED:
                    return decision.why
                if decision.state == BehindState.GO_ON:
                    self.log.warning(
                        "could not get the swarm's newer state; going on from our own (a round of progress lost)",
                        round=self.round,
                        gave_up_on=[pid[-8:] for pid in decision.ahead],
                    )
                    self.memory.give_up_on(decision.ahead, self.round)
                if decision.state in (BehindState.NO, BehindState.GO_ON):
                    if loading:
                        self.board.update(state=PeerState.TRAINING)
                    return None
                if not loading:
                    loading = True
                    self.log.info("behind the swarm, loading state", round=self.round)
                    self.board.update(state=PeerState.LOADING)
                plan = decision.plan
                if decision.state == BehindState.LOAD and plan:
                    if self.load_state(
                        plan.donors, why="catch_up", expect=plan.params_hash, min_round=plan.round
                    ):
                        continue  # the swarm may have moved on meanwhile: look again
                else:
                    waiting.update(
                        f"round {self.round}: waiting for the swarm's newer state",
                        swarm_round=self.memory.highest_round,
                        holders=len(plan.donors) + plan.resting if plan else 0,
                    )
                wait = max(self._poll_s, self.backoff.next_try(time.monotonic()) - time.monotonic())
                self.stop.wait(min(wait, self.cfg.swarm.heartbeat_s * 4))
        return None

    def inner_phase(self) -> RoundStats:
        """H local AdamW steps on this peer's shard of the round; with ``inner.round_seconds``, as many as fit
        in that time (at least one, at most H).

        In a verifiable round the shard comes from the round's assignment, and the inner optimizer and the
        learning rate start afresh (the lr ramping up over ``verification.round_warmup_steps``): what a
        replica computes depends on the round's params and shard only.
        """
        cfg = self.cfg
        ramp = lambda step: 1.0  # noqa: E731
        steps = cfg.inner.num_inner_steps
        if self.verifying:
            ramp = functools.partial(round_warmup, steps=cfg.verification.round_warmup_steps)
            self._await_roster()
            self._realign_reputation()
            rank, world, self._replicas = self.assignment()
            # Replicas do the same steps: with rounds by time, what the slowest of them fits in the round.
            steps = self._replica_steps(self._replicas, self._benchmarks())
            self.inner_opt = make_optimizer(self.diloco.model_params, cfg.inner)
            first_step = self.round * cfg.inner.num_inner_steps
            self._shard = f"{rank}/{world}"
            roster = self._roster_claim()
            claims = dict(
                self._no_claims(),
                shard=self._shard,
                replicas=list(self._replicas),
                roster=[p for p, _ in roster],
                roster_classes=[c for _, c in roster],
            )
        elif self._sync is not None:  # our round is averaged meanwhile: we train the next one
            # Of the round whose sync is in flight: its outer step may have moved self.round on already.
            rank, world = protocol.next_roster(replace(self.me(), round=self._sync.round), self._visible())
            first_step, claims = self.inner_steps_total, {}
        else:
            rank, world = protocol.roster(self.me(), self._visible())
            first_step, claims = self.inner_steps_total, {}
        round_ = self.training_round
        starts = self.corpus.shard(seed=cfg.run.seed, round=round_, rank=rank, world=world)
        batches = self.corpus.batches(starts, cfg.inner.batch_size)
        stats = RoundStats(shard=f"{rank}/{world}")
        # With a sync in flight, our record says averaging (our round) until it lands.
        state = {"state": PeerState.TRAINING} if self._sync is None else {}
        self.board.update(samples_round=0, **state, **claims)
        self.model.train()
        last_beat = time.monotonic()
        dtype = getattr(torch, cfg.device.dtype)
        loss_sum = torch.zeros((), device=self.device)  # summed on device: no host sync per step
        deadline = float("inf") if self.verifying else self._round_deadline(stats.started)
        bar = InnerProgress(
            terminal_progress_enabled(cfg.log.format),
            total=None if deadline != float("inf") else steps,  # a round by time: as many as fit
            round=round_,
        )
        running_loss = lambda: float(loss_sum) / max(stats.steps, 1)  # noqa: E731 - read only when the bar redraws
        step_s = 0.0  # how long our last step took: we stop before one that would end well past the deadline
        # Rounds by steps: past H, train on while the round's slower peers finish (they see us averaging).
        extra = 0 if self.verifying or deadline != float("inf") else cfg.inner.max_steps_while_waiting
        with bar:
            while stats.steps < steps + extra:
                if stats.steps >= steps and not self._train_while_waiting(
                    stats, extra_of=steps, step_s=step_s
                ):
                    break
                if self.stop.is_set() or (stats.steps and time.monotonic() + step_s / 2 >= deadline):
                    break
                if self._sync is not None and self._sync.synced() and not self.land():
                    # That sync failed (the swarm went on without us): these steps are dropped.
                    stats.dropped = True
                    break
                if self.schedule is not None and self.schedule.check() is not None:
                    # Past H the round's work is done and the others count us ready: average it, then pause.
                    stats.paused = stats.steps < steps
                    break
                step_started = time.monotonic()
                x, y = next(batches)
                loss = inner_step(
                    self.model,
                    self.diloco.model_params,
                    self.inner_opt,
                    x.to(self.device, non_blocking=True),
                    y.to(self.device, non_blocking=True),
                    lr=inner_lr(cfg.inner, first_step + stats.steps) * ramp(stats.steps),
                    grad_clip=cfg.inner.grad_clip,
                    autocast_dtype=dtype,
                )
                loss_sum.add_(loss)
                step_s = time.monotonic() - step_started  # without a host sync: a bound, on accelerators
                self.inner_steps_total += 1
                stats.steps += 1
                stats.samples += cfg.inner.batch_size
                telemetry.INNER_STEPS.inc()
                bar.update(stats.steps, stats.samples, running_loss)
                if time.monotonic() - last_beat > cfg.swarm.heartbeat_s:
                    last_beat = time.monotonic()
                    elapsed = last_beat - stats.started
                    self.board.update(
                        samples_round=stats.samples, samples_per_s=stats.samples / max(elapsed, 1e-9)
                    )
        stats.loss_sum = float(loss_sum)
        self.samples_total += stats.samples
        stats.inner_s = time.monotonic() - stats.started
        self.compute_s += stats.inner_s
        telemetry.observe_inner_phase(
            steps=stats.steps, samples=stats.samples, seconds=stats.inner_s, loss=stats.loss
        )
        self.board.update(
            samples_round=stats.samples,
            samples_total=self.samples_total,
            samples_per_s=stats.samples / max(stats.inner_s, 1e-9),
            compute_s=self.compute_s,
        )
        return stats

    def _train_while_waiting(self, stats: RoundStats, *, extra_of: int, step_s: float) -> bool:
        """Past our H steps (``inner.max_steps_while_waiting``): whether to take one more while the round's
        slower peers finish. The first time, we tell them we are done (``averaging``, the full round's weight):
        the barrier then waits for nobody but them. Never while a previous round's sync (overlap) is still in
        flight: our record speaks for that round, and the barrier after it for this one. Nor when a step is
        long beside matchmaking: once the last peer is done we join the group a step late at most, and the
        group's leader waits ``averaging.matchmaking_time_s`` for its members, no longer."""
        if self._sync is not None or step_s > self.cfg.averaging.matchmaking_time_s * STEP_OF_MATCHMAKING:
            return False
        if stats.steps == extra_of:
            self.board.update(state=PeerState.AVERAGING, samples_round=stats.samples)
        # No deadline here: the barrier's own counts from the end of the inner phase.
        if self._barrier_decision(deadline=float("inf")).state != BarrierState.WAIT:
            return False
        stats.steps_while_waiting += 1
        telemetry.STEPS_WHILE_WAITING.inc()
        return True

    def _replica_steps(self, members: Sequence[str], records: dict[str, ProgressRecord]) -> int:
        """The steps each replica of ``members`` does in a verifiable round (``inner.replica_steps``), from
        their published benchmarks in ``records``: the same for every replica and in every peer's verdict."""
        speeds = []
        for p in members:
            record = records.get(p)
            mine = p == self.peer_id
            speeds.append(
                self.benchmark_samples_per_s if mine else record.benchmark_samples_per_s if record else 0.0
            )
        return replica_steps(self.cfg.inner, speeds)

    def _benchmarks(self) -> dict[str, ProgressRecord]:
        """The records :meth:`_replica_steps` reads: a reading of the swarm only for rounds by time."""
        return self._others() if self.cfg.inner.round_seconds else {}

    def _round_deadline(self, started: float) -> float:
        """When this round's inner phase ends: with ``inner.round_seconds``, that long after we left the last
        barrier (or after we started, when we did not just average: a newcomer, a peer that loaded state);
        without it, never (``inner.num_inner_steps`` steps)."""
        deadline, self._next_deadline = self._next_deadline, None
        if not self.cfg.inner.round_seconds:
            return float("inf")
        return deadline if deadline is not None else started + self.cfg.inner.round_seconds

    def barrier(self) -> list[ProgressRecord] | None:
        """Wait for this round's other peers to finish their inner phase; return the group to average with.

        Returns None if the swarm moved past our round meanwhile (our pseudo-gradient is stale: the loop
        then loads the swarm's state) or a stop was requested. Before returning a group, makes sure we hold
        the group's canonical params (rebasing our inner progress onto them if not).
        """
        self.board.update(state=PeerState.AVERAGING)
        deadline = time.monotonic() + self.cfg.averaging.barrier_timeout_s
        # Where the others were as this wait (or its last extension) began: whom a timeout marks as cut off.
        since = {p: protocol.progress_of(r) for p, r in self._visible().items()}
        rounds_since: dict[str, int] | None = None  # waiting on (protocol.waits_on): their rounds then
        with self._waiting() as waiting:
            while True:
                decision = self._barrier_decision(deadline)
                if decision.state == BarrierState.STALE:
                    self.log.info(
                        "the swarm moved past this round: dropping our pseudo-gradient", round=self.round
                    )
                    telemetry.OUTER_STEP_FAILURES.labels(reason="stale").inc()
                    self.diloco.reset_model()
                    return None
                others = self._visible()
                if decision.state == BarrierState.GO and protocol.waits_on(
                    self.me(), others, decision, rounds_since
                ):
                    rounds_since = {p: r.round for p, r in others.items()}
                    since = {p: protocol.progress_of(r) for p, r in others.items()}
                    deadline = time.monotonic() + self.cfg.averaging.barrier_timeout_s
                    self.log.warning(
                        "barrier timeout, nobody ready, and nobody else holds our params: waiting on while "
                        "the peers behind us move",
                        round=self.round,
                        waiting_for=[pid[-8:] for pid in decision.waiting_for],
                    )
                    continue
                if decision.state == BarrierState.GO:
                    break
                waiting.update(
                    f"round {self.round}: waiting for peers to finish it",
                    ready=len(decision.ready),
                    waiting_for=len(decision.waiting_for),
                )
                # Woken by the push of a peer we wait for, as it lands; the decision's clock (timeouts, a
                # peer's record expiring) is read at least every BARRIER_POLL_S.
                self.board.wait_for_news(min(BARRIER_POLL_S, self._poll_s))
                if self.stop.is_set():
                    return None  # stopping: leave the round unfinished rather than step alone
        if decision.timed_out:
            self._waited_out(decision, since)
            self.log.warning(
                "barrier timeout: averaging without slow peers",
                round=self.round,
                ready=len(decision.ready),
                waiting_for=[pid[-8:] for pid in decision.waiting_for],
            )
        group = self.settle(decision.ready) if self.cfg.averaging.settled_groups else decision.ready
        if group is None:
            return None  # stopping
        donors = protocol.rebase_donors(self.me(), group)
        if donors is not None:
            self.log.warning("params differ from the swarm's; rebasing onto them", round=self.round)
            canon = next(r.params_hash for r in group if r.peer_id in donors)
            rebased = self.load_state(donors, why="rebase", expect=canon, rebase=True, round=self.round)
            if rebased and self.verifying:
                # The round's assignment is seeded by its params: ours were not the round's, so neither was
                # the assignment we trained under. Our verdict reads the claims as the others read them, under
                # the round's params (our own work is then misassigned, and we sit the round out): under ours,
                # it disagreed with theirs, we voided rounds they stepped, and rebased again next round, for
                # as many as 7 rounds after a split in the in-memory swarm.
                seed = verify.assignment_seed(self.cfg.run.run_id, self.round, self.diloco.params_hash())
                self._assigned_over = (seed, *self._assigned_over[1:])
        return group

    def _waited_out(self, decision: protocol.Barrier, since: dict[str, protocol.Progress]) -> None:
        """The peers a timed-out barrier waited for are not waited for again for a while; when nobody was
        ready, those that did not move during the wait (``since``: where they were as it began) only until
        they move (:meth:`SwarmMemory.waited_out_on`)."""
        now = {p: protocol.progress_of(r) for p, r in self._visible().items()}
        frozen = {p: now[p] for p in decision.waiting_for if p in now and since.get(p) == now[p]}
        self.memory.waited_out_on(
            decision.waiting_for, self.round, nobody_ready=None if decision.ready else frozen
        )

    def settle(self, ready: list[ProgressRecord]) -> list[ProgressRecord] | None:
        """Say whom our barrier found ready, and return the round's group as its members' say settles it
        (:func:`protocol.settle`): a peer that turned ready as the barriers passed is in all our groups or in
        none. None if a stop was requested."""
        mine = sorted({self.peer_id, *(r.peer_id for r in ready)})
        if len(mine) > MAX_LISTED:  # more than a record lists: nobody's group is settled (nor waited for)
            return ready
        self.board.update(group=mine)
        deadline = time.monotonic() + self.cfg.averaging.matchmaking_time_s
        with self._waiting() as waiting:
            while True:
                others = self._visible()
                settled = protocol.settle(
                    self.peer_id,
                    self.round,
                    mine,
                    others,
                    timed_out=time.monotonic() >= deadline,
                    not_waited=self.memory.unsaid(self.round),
                )
                if settled.done:
                    break
                waiting.update(
                    f"round {self.round}: settling the group", waiting_for=len(settled.waiting_for)
                )
                self.board.wait_for_news(min(BARRIER_POLL_S, self._poll_s))
                if self.stop.is_set():
                    return None
        if settled.waiting_for:
            self.memory.unsaid_on(settled.waiting_for, self.round)
            self.log.warning(
                "the round's group did not settle in time: going on without waiting for these peers",
                round=self.round,
                waited_for=[p[-8:] for p in settled.waiting_for],
            )
        if added := sorted(set(settled.group) - set(mine)):
            self.log.info(
                "the round's group grew: groupmates found peers ready that our barrier had not",
                round=self.round,
                added=[p[-8:] for p in added],
            )
        return [others[p] for p in settled.group if p != self.peer_id]

    def _barrier_decision(self, deadline: float) -> protocol.Barrier:
        """The barrier's decision on the records we hold now (go, wait, or stale)."""
        return protocol.barrier(
            self.me(),
            self._visible(),
            now=time.monotonic(),
            deadline=deadline,
            swarm_finished=self.memory.swarm_finished,
            num_rounds=self.cfg.outer.num_rounds,
            not_waited=self.memory.waited_out(self.round),
        )

    # ------------------------------------------------------------------- a verifiable round's phases

    def assignment(self) -> tuple[int, int, tuple[str, ...]]:
        """Our shard of this round (index, count) and its replica group: :func:`verify.assign` over the
        round's roster, seeded by the round's params."""
        me, others = self.me(), self._visible()
        members = [
            verify.Member(pid, self._numeric_class_of(pid, others), self.reputation.trusted(pid))
            for pid in protocol.roster_ids(me, others)
            if pid not in self.reputation.banned
        ]
        seed = verify.assignment_seed(self.cfg.run.run_id, self.round, me.params_hash)
        # What the verdict checks claims against: the assignment over the roster most peers name, each member
        # with the class the vote gives it, trusted as the reputation stands now (alike on every peer: a
        # referee's strike later this round changes nothing here).
        trusted = frozenset(p for p in self.reputation.agreed if self.reputation.trusted(p))
        roster = tuple(sorted((m.peer, m.numeric_class) for m in members))
        self._assigned_over = (seed, roster, trusted)
        plan = self._plan(roster)
        index = plan.shard_of(self.peer_id)
        if index is None:  # we are banned in our own view: train the roster rank's shard, nobody counts it
            rank, world = protocol.roster(me, others)
            return rank, world, (self.peer_id,)
        return index, plan.shards, plan.groups[index]

    def _realign_reputation(self) -> None:
        """Take the swarm's reputation where ours drifted from it (:func:`verify.swarm_reputation`): download
        our round's state from a trusted peer whose record carries the digest most trusted peers carry, and
        take its reputation only if it is exactly that one. Our params are theirs: only the reputation (and
        the disputes pending with it) changes."""
        me = self.me()
        peers = [
            r
            for r in live(self._visible()).values()
            if r.round == self.round
            and r.state in (PeerState.TRAINING, PeerState.AVERAGING)
            and r.params_hash == me.params_hash
            and self.reputation.trusted(r.peer_id)
        ]
        mine = self._reputation_digest()
        target = verify.swarm_reputation(
            mine, [r.reputation for r in peers], trusted_self=self.reputation.trusted(self.peer_id)
        )
        if target is None:
            return
        # Two tries at most, of donors not resting after a failure: a realignment holds up our round's start.
        resting = self.backoff.resting(time.monotonic())
        donors = sorted(
            r.peer_id for r in peers if r.reputation == target and r.serves and r.peer_id not in resting
        )
        donors = donors[:REALIGN_TRIES]
        self.log.warning(
            "our reputation is not the one most trusted peers carry: taking theirs",
            round=self.round,
            ours=mine or "none",
            theirs=target,
            of=len(peers),
        )
        if self.load_state(
            donors, why="realign", expect=me.params_hash, round=self.round, reputation_digest=target
        ):
            telemetry.REALIGNMENTS.inc()

    def _roster_claim(self) -> verify.Roster:
        """The roster our record names: none beyond MAX_LISTED peers (the verdict then checks no assignment)."""
        roster = self._assigned_over[1]
        return roster if len(roster) <= MAX_LISTED else ()

    def _plan(self, roster: verify.Roster) -> verify.Assignment:
        """The round's assignment over ``roster``: each member of the class it names, trusted as the swarm's
        reputation stood at our assignment. Nothing here is read from the swarm now: peers that read the
        same claims must plan alike, whatever a member's record says by the time each of them judges."""
        seed, _, trusted = self._assigned_over
        members = [verify.Member(p, c, p in trusted) for p, c in roster]
        v = self.cfg.verification
        return verify.assign(members, seed, replicas=v.replicas, audit_fraction=v.audit_fraction)

    def _await_roster(self) -> None:
        """Wait while peers of the previous round are still averaging, sitting it out or loading its result:
        they are about to come into ours, and replicas must compute the round's assignment from one roster."""
        deadline = time.monotonic() + self.cfg.verification.reveal_timeout_s
        with self._waiting() as waiting:
            while time.monotonic() < deadline and not self.stop.is_set():
                records = live(self._others())
                coming = [
                    p
                    for p, r in records.items()
                    if r.round == self.round - 1 and r.state in (PeerState.AVERAGING, PeerState.LOADING)
                ]
                if not coming:
                    return
                waiting.update(f"round {self.round}: waiting for the roster", coming=len(coming))
                self.stop.wait(self._poll_s)

    def _on_wire(self, delta: list[torch.Tensor]) -> verify.Wire:
        """``delta`` cut, encoded and decoded exactly as our averager sends it (packed or not)."""
        return verify.wire(self.layout.pack(delta), self.layout.codec, self.layout.part_size_bytes)

    def seal(self) -> None:
        """Publish a seal of the parts we will send and a fresh nonce, before anyone reveals anything."""
        self._wire = self._on_wire(self.diloco.pseudo_gradient())
        self._digest = verify.commitment(self._wire.digests)
        self._nonce = secrets.token_hex(16)
        self.board.update(seal=verify.sealed(self._digest, self._nonce))

    def verify_round(self, group: list[ProgressRecord], stats: RoundStats) -> list[ProgressRecord] | None:
        """Reveal, sketch, and judge the round; return the groupmates to average with, or None if our own
        replica group is left out (we then sit the round out and get its result from the swarm).

        Our nonce is revealed once every replica groupmate has sealed; the sketch's seed is made of the
        group's nonces, so nobody knew it while fixing their pseudo-gradient. The verdict
        (:func:`verify.judge_round`) reads the records only, so peers that read the same claims reach the same
        one; each stays in the round until the others have judged (:meth:`_await_verdicts`), so that they do.
        """
        round_ = self.round
        deadline = time.monotonic() + self.cfg.verification.reveal_timeout_s
        ready = {r.peer_id for r in group}
        mates = [p for p in self._replicas if p != self.peer_id and p in ready]
        self._await_claims(mates, "seal", round_, deadline)
        wire = self._wire
        assert wire is not None, "seal() comes first"
        self.board.update(digest=self._digest, nonce=self._nonce, parts=wire.digests)
        seen = self._await_claims(mates, "nonce", round_, deadline)
        sketch = None
        if all(p in seen and seen[p].nonce for p in mates):
            # Only with the whole group's seed: a sketch under part of it would disagree with a groupmate that
            # revealed late, and a referee (who uses the whole seed) would then convict us.
            nonces = [self._nonce, *(seen[p].nonce for p in mates)]
            sketch = self._sketch(verify.group_seed(self.cfg.run.run_id, round_, nonces))
            self.board.update(sketch=sketch.numpy().tobytes())
        seen = self._await_claims(sorted(ready), "sketch", round_, deadline)
        claims = [verify.Claim.of(r) for r in seen.values()]
        claims.append(
            verify.Claim(
                self.peer_id,
                self.numeric_class,
                self._shard,
                self._replicas,
                seal=verify.sealed(self._digest, self._nonce),
                digest=self._digest,
                nonce=self._nonce,
                sketch=None if sketch is None else sketch.double(),  # as the others read it from our record
                parts=wire.digests,
                roster=self._roster_claim(),
            )
        )
        self.settle_disputes(round_)  # referees' reports on earlier rounds: strikes and bans count from now
        verdict = verify.judge_round(
            claims,
            run_id=self.cfg.run.run_id,
            round=round_,
            trusted=self.reputation.trusted,
            banned=self.reputation.banned.__contains__,
            tolerances=self._tolerances(round_),
            plan=self._plan,
        )
        self.verdicts.append((round_, verdict))
        self._await_verdicts(verdict, [c.peer for c in claims if c.peer != self.peer_id], round_)
        self.reputation.agree([p for g in verdict.agreed for p in g])
        telemetry.observe_verdict(verdict, self.reputation)
        self.board.update(**self.reputation.listed(MAX_LISTED))  # for `p2ptrain status`, with the next beat
        self.log.info(
            "verified the round",
            round=round_,
            agreed=[[p[-8:] for p in g] for g in verdict.agreed],
            dissent=[[p[-8:] for p in g] for g in verdict.dissent],
            counted=len(verdict.shares),
            distances={f"{a[-8:]}-{b[-8:]}": round(d, 4) for (a, b), d in verdict.distances.items()},
        )
        if verdict.left_out:
            self.log.warning(
                "left peers out of the round: their work was not verified",
                round=round_,
                left_out={p[-8:]: why.value for p, why in sorted(verdict.left_out.items())},
            )
        found = verify.disputes(
            verdict, claims, run_id=self.cfg.run.run_id, round=round_, trusted=self.reputation.trusted
        )
        for dispute in found:
            self.log.info(
                "a referee will recompute a dissenting group's shard",
                round=round_,
                group=[p[-8:] for p in dispute.group],
                referee=dispute.referee[-8:],
            )
            self.disputes.append(dispute)
            if dispute.referee == self.peer_id:  # we recompute it next round, from this round's params
                self._referee_jobs.append((dispute, [m.clone() for m in self.diloco.master]))
        if not verdict.shares:
            # Nobody's work was verified (two peers that disagree, say): every peer of the round reaches this
            # same verdict, and the round is void for all, rather than trained again with the same shards.
            self.log.warning("nobody's work was verified: the round is void, params unchanged", round=round_)
            self.diloco.void_round()
            self.rounds_voided.append(round_)
            self.board.update(
                round=self.round,
                state=PeerState.TRAINING,
                **self._no_claims(),
                **self._reputation_as_of_step(),
            )
            return None
        if self.peer_id in verdict.left_out:
            self.diloco.reset_model()
            self._sit_out(round_, [p for p in verdict.shares])
            return None
        # Reducers count each groupmate with the verdict's weight (its replica group's inner phase's samples,
        # shared by its replicas), never with what it claims.
        batch = self.cfg.inner.batch_size
        groups = {c.peer: c.replicas for c in claims}  # the verdict counts only groups of the assignment
        records = self._benchmarks()  # one reading for every group's steps
        weights = {
            p: self._replica_steps(groups.get(p) or (p,), records) * batch * share
            for p, share in verdict.shares.items()
        }
        # Reducers also check every part they receive against what its sender sealed and sketched.
        sealed = verify.sealed_parts(verdict, claims, run_id=self.cfg.run.run_id, round=round_)
        self.averager.leave_out([p for p in verdict.left_out if p != self.peer_id], round_, weights, sealed)
        stats.weight = weights[self.peer_id]
        return [r for r in group if r.peer_id in verdict.shares]

    def _sketch(self, seed: int) -> torch.Tensor:
        """Our sketch under the group's seed (float32): of the parts we will send, as reducers decode them."""
        assert self._wire is not None, "seal() comes first"
        return verify.sketch(self._wire.parts, seed).float()

    def referee(self) -> None:
        """Recompute a dissenting group's shard of an earlier round from that round's params, exactly as its
        replicas were to, and publish the sketch under the group's seed (one dispute per round)."""
        # Disputes are settled at the next round's verdict: only a job of the previous round is still useful.
        self._referee_jobs = [j for j in self._referee_jobs if j[0].round == self.round - 1]
        if not self._referee_jobs:
            return
        dispute, start = self._referee_jobs.pop(0)
        self._referee_jobs.clear()  # one per round: the record has one slot; the others go unsettled
        shard = verify.parse_shard(dispute.shard, self.corpus.num_train_windows())
        if shard is None:
            self.log.warning(
                "cannot referee: the group claimed a shard that does not exist", shard=dispute.shard
            )
            return
        self.log.info("refereeing", round=dispute.round, group=[p[-8:] for p in dispute.group])
        delta = self._replay(dispute.round, *shard, start)
        sketch = verify.sketch(self._on_wire(delta).parts, dispute.seed)
        self.board.update(
            ref_round=dispute.round,
            ref_group=list(dispute.group),
            ref_sketch=sketch.float().numpy().tobytes(),
        )
        self._my_referee_report = (dispute.round, dispute.group, sketch.float().double())

    def _replay(self, round_: int, index: int, count: int, start: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pseudo-gradient of shard ``index/count`` of ``round_`` from params ``start``: the steps of a
        verifiable round's inner phase, without its reporting."""
        cfg = self.cfg
        with torch.no_grad():
            for p, s in zip(self.diloco.model_params, start):
                p.copy_(s.to(p.device, p.dtype))
        optimizer = make_optimizer(self.diloco.model_params, cfg.inner)
        starts = self.corpus.shard(seed=cfg.run.seed, round=round_, rank=index, world=count)
        batches = self.corpus.batches(starts, cfg.inner.batch_size)
        self.model.train()
        for step in range(cfg.inner.num_inner_steps):
            x, y = next(batches)
            inner_step(
                self.model,
                self.diloco.model_params,
                optimizer,
                x.to(self.device),
                y.to(self.device),
                lr=inner_lr(cfg.inner, round_ * cfg.inner.num_inner_steps + step)
                * round_warmup(step, cfg.verification.round_warmup_steps),
                grad_clip=cfg.inner.grad_clip,
                autocast_dtype=getattr(torch, cfg.device.dtype),
            )
        with torch.no_grad():
            delta = [s - p.detach().to("cpu", torch.float32) for s, p in zip(start, self.diloco.model_params)]
        self.diloco.reset_model()
        return delta

    def settle_disputes(self, round_: int) -> None:
        """Read the referees' reports on pending disputes: strike (and perhaps ban) whom a referee convicts.

        A referee is a pure function of the verdict, and its report sits in its signed record, published
        before its next inner phase (the next round's barrier waits for it): a dispute of round r is settled
        at round r + 1's verdict, by every peer alike, and dropped if the report is not there then.
        """
        records = self._others()
        pending = []
        for dispute in self.disputes:
            if dispute.round >= round_:
                pending.append(dispute)
                continue
            report = self._referee_report(dispute, records) if dispute.round == round_ - 1 else None
            if report is None:
                self.log.warning(
                    "a dispute went unsettled: its referee did not report in time",
                    round=round_,
                    dispute_round=dispute.round,
                    referee=dispute.referee[-8:],
                )
                continue
            convicted = sorted(verify.refereed(dispute.reports, report, self._tolerances(dispute.round)))
            banned = self.reputation.convict(convicted, dispute.round)
            telemetry.observe_convictions(convicted, banned, self.reputation)
            if banned:
                self.averager.ban(sorted(banned))
            log_ = self.log.warning if convicted else self.log.info
            log_(
                "a referee settled a dispute",
                round=round_,
                dispute_round=dispute.round,
                group=[p[-8:] for p in dispute.group],
                convicted=[p[-8:] for p in convicted],
                banned=[p[-8:] for p in sorted(banned)],
                strikes={p[-8:]: len(self.reputation.strikes.get(p, [])) for p in convicted},
            )
        self.disputes = pending

    def _referee_report(
        self, dispute: verify.Dispute, records: dict[str, ProgressRecord]
    ) -> verify.Report | None:
        if dispute.referee == self.peer_id:
            mine = self._my_referee_report
            if mine is None or mine[:2] != (dispute.round, dispute.group):
                return None
            cls = dispute.referee_class or self.numeric_class
            return verify.Report(self.peer_id, cls, mine[2], float(mine[2].norm()))
        r = records.get(dispute.referee)
        if r is None or r.ref_round != dispute.round or tuple(sorted(r.ref_group)) != dispute.group:
            return None
        claim = verify.Claim.of(r.copy(update={"sketch": r.ref_sketch}))
        if claim.sketch is None:
            return None
        # The class the round's roster vote gave the referee: the one its record states now could differ
        # between two peers' reads, and so would their convictions.
        cls = dispute.referee_class or r.numeric_class
        return verify.Report(r.peer_id, cls, claim.sketch, float(claim.sketch.norm()))

    def _tolerances(self, round_: int) -> verify.Tolerances:
        """The verdict's tolerances in ``round_``: mixed-class pairs get the largest in the grace rounds."""
        v = self.cfg.verification
        mixed = verify.MAX_TOLERANCE if round_ < v.grace_rounds else v.mixed_tolerance
        return verify.ByClass(v.tolerance, mixed)

    def _await_verdicts(self, verdict: verify.RoundVerdict, peers: Sequence[str], round_: int) -> None:
        """Publish our verdict's digest, and stay in the round until the peers whose claims we judged have
        published theirs: a peer that left the round at once (a void round, say) would take its claims with it
        before slower peers had read them. Says so when a peer reached another verdict."""
        digest = verdict.digest()
        self.board.update(verdict=digest)
        deadline = time.monotonic() + self.cfg.verification.reveal_timeout_s
        seen = self._await_claims(peers, "verdict", round_, deadline)
        differ = sorted(p[-8:] for p, r in seen.items() if r.verdict and r.verdict != digest)
        if differ:
            telemetry.SPLIT_VERDICTS.inc()
            self.log.warning(
                "peers reached another verdict on this round: they read other claims",
                round=round_,
                peers=differ,
                of=len(seen),
            )

    def _await_claims(
        self, peers: Sequence[str], field_name: str, round_: int, deadline: float
    ) -> dict[str, ProgressRecord]:
        """Wait until every one of ``peers`` that is still in our round shows ``field_name`` in its record,
        or ``deadline``; return their records of our round.

        Claims are published at once, and replicas finish their phases close together: the first reads come
        fast (from 50 ms), then slower, up to the usual poll, so that a long wait costs no more reads."""
        delay = min(CLAIM_POLL_START_S, self._poll_s)
        with self._waiting() as waiting:
            while True:
                records = {pid: r for pid, r in self._others().items() if pid in peers}
                here = {
                    pid: r
                    for pid, r in records.items()
                    if r.round == round_ and r.state == PeerState.AVERAGING
                }
                missing = [pid for pid, r in here.items() if not getattr(r, field_name)]
                if not missing or time.monotonic() > deadline or self.stop.is_set():
                    return here
                waiting.update(f"round {round_}: waiting for replicas' {field_name}", missing=len(missing))
                self.stop.wait(delay)
                delay = min(2 * delay, self._poll_s)

    def _sit_out(self, round_: int, counted: Sequence[str]) -> None:
        """Wait while the peers that count finish ``round_`` without us (the loop then loads their state), or
        until they cannot still be averaging."""
        a = self.cfg.averaging
        deadline = (
            time.monotonic()
            + (1 + a.retries) * (a.matchmaking_timeout_s + a.allreduce_timeout_s)
            + self._again_for_s()
        )
        with self._waiting() as waiting:
            while time.monotonic() < deadline and not self.stop.is_set():
                records = self._others()
                busy = [
                    p
                    for p in counted
                    if p in records and records[p].round == round_ and records[p].state == PeerState.AVERAGING
                ]
                if not busy:
                    return
                waiting.update(
                    f"round {round_}: left out, waiting for the swarm's result", averaging=len(busy)
                )
                self.stop.wait(self._poll_s)

    def outer_sync(self, group: list[ProgressRecord], stats: RoundStats) -> OuterStepReport:
        """Average pseudo-gradients with ``group`` (weighted by samples) and take the outer step."""
        t0 = time.monotonic()
        alone = len(group) + 1 < max(self.cfg.averaging.min_group_size, 2)
        round_ = self.round
        if not alone:
            # The barrier's group: nobody searches for it, nobody waits out a timer.
            clients = [r.peer_id for r in group if not r.serves]
            if self.cfg.swarm.client_mode:
                clients.append(self.peer_id)
            self.averager.expect_group([self.peer_id, *(r.peer_id for r in group)], round_, clients)
        with self._waiting() as waiting:
            waiting.update(f"round {round_}: averaging", peers=len(group) + 1)
            report = self.diloco.sync(
                None if alone else self.averager,
                weight=stats.weight if stats.weight is not None else self._weight_of(stats.samples),
                round=round_,
                fallback=self._may_step_alone,
                again=functools.partial(
                    self._average_again, round_, [r.peer_id for r in group], t0 + self._again_for_s()
                ),
            )
        stats.sync_s = time.monotonic() - t0
        if (
            self.cfg.inner.round_seconds and not self.verifying and not self.overlapping
        ):  # verifiable rounds count steps (_replica_steps); overlapped ones left the barrier as they started
            # The next round's deadline counts from the moment we left the barrier, as every member of the group
            # did, within a poll of each other: our all-reduce, evaluation and bookkeeping come out of our own
            # training time (a slow device is slow at those too), not out of the others' (they would wait for us
            # at the next barrier).
            self._next_deadline = t0 + self.cfg.inner.round_seconds
        # Our reputation as of entering the round we are now in: unchanged where the round did not move on (the
        # sync failed), whose verdict we have judged already.
        reputation = self._reputation_as_of_step() if self.round > round_ else {}
        new = set(report.refused) - self.refused  # what our reducers caught (not bans: a ban can be lifted)
        if new:
            # Our reducer caught them (a part they had not sealed, say): we neither wait for them nor read their
            # records from now on, as for a banned peer. Every reducer they cheated does the same.
            self.log.warning(
                "left peers out for good: they misbehaved in an all-reduce", peers=sorted(p[-8:] for p in new)
            )
            self.refused |= new
        if report.applied:
            self.rounds_applied.append(round_)
            self.rounds_contributed += 1
            self.last_group_size = report.group_size
            self.memory.averaged_with(report.peers)
        if report.stalled:
            # Our averager refuses them for a while (LeftOut): the barrier does not wait for them meanwhile.
            self.memory.waited_out_on(report.stalled, round_)
        self.board.update(
            round=self.round,
            state=PeerState.TRAINING,
            params_hash=self.diloco.params_hash(),
            last_group_size=self.last_group_size,
            samples_round=0,
            rounds_contributed=self.rounds_contributed,
            **self._no_claims(),
            **reputation,
        )
        return report

    def _waiting(self) -> Waiting:
        # A sync in the background (overlap) waits without a spinner: the inner phase's bar has the terminal.
        return Waiting(terminal_progress_enabled(self.cfg.log.format) and self._sync is None, self.log)

    def _weight_of(self, samples: int) -> float:
        """Our weight in a round that is not verified: our samples, at most a full round's (H x batch, what
        reducers allow): steps past H (``inner.max_steps_while_waiting``) add progress, not weight."""
        cfg = self.cfg.inner
        return max(min(samples, cfg.num_inner_steps * cfg.batch_size), 1)

    def _again_for_s(self) -> float:
        """How long after its start a round's sync may begin one more attempt for a groupmate held up in an
        attempt of its own: the longest a groupmate's first attempt takes (a search, then an all-reduce that a
        staller holds up to its timeout, dripping a part now and then), then the search of its retry, which
        ours must overlap."""
        a = self.cfg.averaging
        return 2 * a.matchmaking_timeout_s + a.allreduce_timeout_s

    def _average_again(self, round_: int, group: Sequence[str], deadline: float) -> bool:
        """After our attempts at ``round_``'s all-reduce failed: whether to make one more, for groupmates still
        averaging it (:func:`protocol.still_averaging`) that our averager does not leave out of it, until
        ``deadline``. Waits ``averaging.request_timeout_s`` before it: attempts that fail at once (an averager
        that cannot work) must not turn into a busy loop."""
        if self.stop.is_set() or time.monotonic() > deadline:
            return False
        counted = set(group) - set(self.averager.left_out_of(group, round_))
        waiting = protocol.still_averaging(replace(self.me(), round=round_), self._visible(), counted)
        if not waiting:
            return False
        self.log.info(
            "averaging failed while groupmates are still averaging the round: trying again",
            round=round_,
            peers=[p[-8:] for p in waiting],
        )
        return not self.stop.wait(self.cfg.averaging.request_timeout_s)

    def _may_step_alone(self) -> bool:
        if protocol.may_step_alone(self.me(), self._visible(), swarm_finished=self.memory.swarm_finished):
            return True
        self.log.warning("averaging failed and the swarm moved on; will load its state", round=self.round)
        return False

    def log_round(self, report: OuterStepReport, stats: RoundStats, *, behind: bool = False) -> None:
        """The round's warnings, its evaluation if it is ours, its metrics and its log line.

        ``behind`` (``device.evaluate_in_background``): our evaluation runs on a copy of the new params in a
        background thread while the next round trains, and the log line follows it there; never the last
        round's, which every peer evaluates before it ends."""
        if report.failure == "non_finite":
            self.log.warning(
                "pseudo-gradient has NaN or Inf: not sent, this round's local work dropped, state kept",
                round=report.round,
            )
        if report.outliers:
            self.log.warning(
                "left groupmates' parts out of the aggregate: far beyond the others' spread",
                round=report.round,
                parts_by_peer=report.outliers,
                hint="a broken or hostile peer, or one of another run or config (averaging.reject_radius)",
            )
        duration = time.monotonic() - stats.started  # the round itself, before this peer's evaluation
        # One evaluation per group and evaluated round (data.eval_every), in turn (data.eval_by): the others
        # train on meanwhile. Everyone evaluates the last round's params, the run's final figure.
        evaluated_by = protocol.evaluator(
            self.peer_id,
            report.peers if report.group_size > 1 else [],
            report.round,
            every=self.cfg.data.eval_every,
        )
        if evaluated_by is not None and self.cfg.data.eval_by == "all":
            evaluated_by = self.peer_id
        last = self.round >= self.cfg.outer.num_rounds
        if last:
            evaluated_by = self.peer_id
        done = functools.partial(
            self._round_done, duration=duration, evaluated_by=evaluated_by, at=self.round
        )
        if behind:  # the training thread: the one before first (its log line, its val loss), in order
            self._finish_evaluation()
        if evaluated_by == self.peer_id and behind and not last:
            self._load_eval_model()  # the params as they are now: the next outer step may come before it ends
            self._evaluating = _Background(
                lambda _: report,
                functools.partial(done, on_copy=True),
                stats,
                round=report.round,
                steps=self.inner_steps_total,
            ).start()
        else:
            done(report, stats)

    def _round_done(
        self,
        report: OuterStepReport,
        stats: RoundStats,
        *,
        duration: float,
        evaluated_by: str | None,
        at: int,
        on_copy: bool = False,
    ) -> None:
        """The round's evaluation when it is ours (the round has brought us to round ``at``; ``on_copy``: of
        the params already in the evaluation copy), then its metrics and its log line."""
        val_loss = None
        if evaluated_by == self.peer_id:
            with stats.timing("eval"):
                val_loss = self._evaluate(on_copy=on_copy)
            self.val_losses.append((at, val_loss))
        telemetry.observe_outer_step(
            report,
            round=at,
            duration_s=duration,
            phases={
                "barrier": stats.barrier_s,
                "verify": stats.verify_s,
                "sync": stats.sync_s,
                "eval": 0.0 if on_copy else stats.eval_s,  # beside training, not a wait
            },
            val_loss=val_loss,
        )
        # The canonical line: one per outer step, everything a person or a log pipeline needs about the round.
        self.log.info(
            "outer step",
            round=report.round,
            train_loss=round(stats.loss, 4),
            val_loss=None if val_loss is None else round(val_loss, 4),
            evaluated_by=evaluated_by[-8:] if evaluated_by is not None else None,
            samples=stats.samples,
            steps_while_waiting=stats.steps_while_waiting,
            shard=stats.shard,
            group_size=report.group_size,
            outlier_parts=sum(report.outliers.values()),
            fallback=report.failure,
            bytes_sent=report.bytes_sent,
            bytes_received=report.bytes_received,
            delta_norm=round(report.delta_norm, 4),
            duration_s=round(duration, 2),
            inner_s=round(stats.inner_s, 3),
            barrier_s=round(stats.barrier_s, 3),
            verify_s=round(stats.verify_s, 3),
            sync_s=round(stats.sync_s, 3),
            matchmaking_s=round(report.matchmaking_s, 3),
            allreduce_s=round(report.allreduce_s, 3),
            eval_s=round(stats.eval_s, 3),
        )

    def _load_eval_model(self) -> None:
        """Copy the master params into the evaluation copy of the model."""
        assert self._eval_model is not None, "setup() makes it"
        params = self.diloco.snapshot().params
        with torch.no_grad():
            for p, m in zip((p for p in self._eval_model.parameters() if p.requires_grad), params):
                p.copy_(m.to(p.device, p.dtype))

    def _evaluate(self, *, on_copy: bool = False) -> float:
        """The validation loss of the master params: the model's, or, while it trains on (overlap), the
        evaluation copy's; ``on_copy``: of the params already loaded into the copy."""
        model: torch.nn.Module = self.model
        if self.overlapping and not on_copy:
            self._load_eval_model()
        device = self.device
        if self.overlapping or on_copy:
            assert self._eval_model is not None, "setup() makes it"
            model, device = self._eval_model, self._eval_device
        return evaluate(model, self.corpus, self.cfg, device)["val_loss"]

    def maybe_checkpoint(self) -> None:
        every = self.cfg.checkpoint.every_rounds
        if every and self.round % every == 0:
            self.save(f"round-{self.round:06d}.safetensors")
            checkpoint.prune(self.checkpoint_dir, self.cfg.checkpoint.keep_last)

    def finish(self) -> RunResult:
        """The last round is done: serve our final state while others need it, and end with the swarm's.

        ``final.safetensors`` is written at once when our params are the canonical final ones among those
        we have seen, and again if we adopt others'. A peer that ends holding other params than the swarm's
        final ones renames it ``diverged.safetensors`` and says so.
        """
        self.board.update(state=PeerState.DONE, params_hash=self.diloco.params_hash())
        self._others()  # the final states already published, before we decide what to write
        path = self.checkpoint_dir / FILE_NAMES[Outcome.FINAL]
        if protocol.final_verdict(self.me(), self.memory):
            self.save(Outcome.FINAL)
        deadline = time.monotonic() + self.cfg.swarm.linger_s
        no_holder_since: float | None = None
        while not self.stop.is_set():
            decision = protocol.linger(self.me(), self._others(), self.memory)
            if decision.state == LingerState.LEAVE:
                break
            if decision.state == LingerState.ADOPT:
                # No live holder of the canonical final params: one reading can miss a record; a record
                # missing for record_ttl_s is gone.
                no_holder_since = None if decision.donors else (no_holder_since or time.monotonic())
                if no_holder_since and time.monotonic() - no_holder_since > self.cfg.swarm.record_ttl_s:
                    break
                donors = [d for d in decision.donors if d not in self.backoff.resting(time.monotonic())]
                if donors:
                    self.log.warning("final params differ from the swarm's; adopting them", round=self.round)
                final = protocol.final_params_hash(self.me(), self.memory) or ""
                if donors and self.load_state(donors, why="adopt", expect=final, round=self.round):
                    self.save(Outcome.FINAL)
                    self.board.update(params_hash=self.diloco.params_hash())
                    continue
            if time.monotonic() > deadline:
                break
            self.stop.wait(self._poll_s)
        if protocol.final_verdict(self.me(), self.memory):
            if not path.is_file():
                self.save(Outcome.FINAL)
            self.log.info("finished", round=self.round, path=str(path), params_hash=self.diloco.params_hash())
            return RunResult(Outcome.FINAL, path)
        diverged = self.save(Outcome.DIVERGED)
        path.unlink(missing_ok=True)
        reason = (
            f"finished with params {self.diloco.params_hash()} but the swarm's final params are "
            f"{protocol.final_params_hash(self.me(), self.memory)} and no peer served them; "
            f"this peer's params are in {diverged}, not the swarm's final model"
        )
        self.log.error("diverged from the swarm", reason=reason)
        return RunResult(Outcome.DIVERGED, diverged, reason)

    def end_stranded(self, why: protocol.Stranded) -> RunResult:
        path = self.save(Outcome.STRANDED)
        reason = (
            f"this peer is at round {self.round} but the swarm reached round {self.memory.highest_round}: "
            f"{why.value}. Its own state is in {path}; it did not train rounds the swarm had left behind"
        )
        self.log.error("left behind by the swarm", reason=reason)
        return RunResult(Outcome.STRANDED, path, reason)

    def shutdown(self) -> None:
        """Stop the averager, the heartbeat, the DHT child and p2pd; let go of our directory. Safe to call twice."""
        if self.link is not None:
            self.link.shutdown()
            self.link = None
        if self.peer_dir is not None:
            self.peer_dir.release()

    # ------------------------------------------------------------------------------ state moves

    def resume_from_checkpoint(self) -> None:
        """Continue from the newest valid checkpoint of this experiment in checkpoint.dir, if any.

        What this peer had seen of the swarm comes back from every file there (a diverged final included,
        though it is never resumed from): a peer left behind before its restart is still behind. The
        reputation comes from the file the state comes from (it is the reputation as of that round, which
        the peer donates and judges with, as its swarm did then); from the newest file where none resumes.
        """
        reputations: dict[Path, object] = {}
        for path in checkpoint.candidates(self.checkpoint_dir, resumable_only=False):
            saved = checkpoint.read_swarm_memory(path, self.cfg.resumable_hashes())
            self.memory.restore(saved)
            if saved:
                reputations[path] = saved.get("reputation")
        resumed = checkpoint.resume_latest(
            self.checkpoint_dir,
            self.model,
            self.diloco,
            self.inner_opt,
            self.cfg.resumable_hashes(),
            on_refused=lambda path, reason: self.log.warning(
                "refused a checkpoint", path=str(path), reason=reason
            ),
        )
        if resumed is not None:  # never a refused file's: its bans and strikes are of another round
            self.reputation.restore(reputations.get(resumed[0]))
            self.disputes = verify.Dispute.pending_of(reputations.get(resumed[0]))
        elif reputations:  # newest first
            self.reputation.restore(next(iter(reputations.values())))
        if self.verifying and self.reputation.banned:
            self.averager.ban(sorted(self.reputation.banned))
        self._reputation_as_of_step()
        if resumed is None:
            return
        path, state = resumed
        self.resumed_round = state.round
        self.inner_steps_total = state.counters.get("inner_steps_total", 0)
        self.samples_total = state.counters.get("samples_total", 0)
        self.compute_s = state.counters.get("compute_ms", 0) / 1000
        self.rounds_contributed = state.counters.get("rounds_contributed", 0)

        self.log.info(
            "resumed from checkpoint",
            path=str(path),
            round=state.round,
            inner_optimizer=bool(state.inner),
            inner_steps_total=self.inner_steps_total,
        )

    def load_state(
        self,
        donors: Sequence[str],
        *,
        why: str,
        expect: str,
        rebase: bool = False,
        round: int | None = None,
        min_round: int = 0,
        reputation_digest: str | None = None,
    ) -> bool:
        """Download a donor's state, check it, and adopt it. Donors that fail are asked again only later.

        Args:
            donors: peer ids to try, in order.
            why: catch_up, rebase, adopt or realign (logged, and kept in ``self.loads``).
            expect: the params hash (of params and outer momentum) the swarm's peers report for the state of
                round ``round`` (or ``min_round``) (:func:`protocol.credible` records): a donor that serves
                another state or round is refused, whatever its checksum says, unless the swarm vouches for
                that one.
            rebase: keep our inner progress (our pseudo-gradient) on top of the new params; otherwise the
                model restarts from the downloaded params.
            round: accept only a state of this round; min_round: of this round or later.
            reputation_digest: take the donor's reputation only if it is exactly this one (most trusted
                peers carry it: :meth:`_realign_reputation`), rather than if the records back it.
        """
        for donor in donors:
            delta = self.diloco.pseudo_gradient() if rebase else None
            problem = self._adopt_state_of(
                donor,
                expect=expect,
                round=round,
                min_round=min_round,
                reputation=not rebase,
                reputation_digest=reputation_digest,
            )
            if problem is not None:
                self.log.warning("refused a state", donor=donor[-8:], reason=problem)
                self.refusals.append((donor, problem))
                self.backoff.failed(donor, time.monotonic())
                continue
            if delta is not None:
                self.diloco.rebase(delta)
            self.backoff.succeeded(donor)
            self.memory.behind_since = None  # progress: the catch-up timeout starts over
            # A rebase stays in our round: our claims and the reputation we donate stand.
            claims = {} if rebase else {**self._no_claims(), **self._reputation_as_of_step()}
            self.board.update(round=self.round, params_hash=self.diloco.params_hash(), **claims)
            telemetry.STATE_LOADS.inc()
            telemetry.ROUND.set(self.round)
            self.loads.append((why, self.round))
            self._next_deadline = None  # that all-reduce was not ours: the next round counts from its start
            self.log.info(
                "loaded state",
                why=why,
                donor=donor[-8:],
                round=self.round,
                params_hash=self.diloco.params_hash(),
            )
            return True
        return False

    def _adopt_state_of(
        self,
        donor: str,
        *,
        expect: str,
        round: int | None,
        min_round: int,
        reputation: bool = True,
        reputation_digest: str | None = None,
    ) -> str | None:
        """Download ``donor``'s state, check it and load it into DiLoCo; None, or why it was refused.

        ``reputation``: also take the swarm's reputation from it (not in a rebase: that is the same round,
        whose verdict we reach ourselves); ``reputation_digest``: only if it is exactly this one."""
        got = fetch_state(
            self.averager,
            donor,
            timeout=self.cfg.swarm.state_download_timeout_s,
            run_id=self.cfg.run.run_id,
            config_hash=self.cfg.training_hash(),
            round=round,
            min_round=min_round,
        )
        if isinstance(got, str):
            return got
        meta, tensors = got
        # What the swarm's peers report is a hash of params and momentum (DiLoCo.params_hash) in a round: a
        # donor can get the params from anyone, but not pass off its own momentum or another round number.
        served, expect_round = tensors_hash(tensors), round if round is not None else min_round
        # The donor may have moved on since we chose it: its newer state is fine if the swarm vouches for it.
        if (served, meta["round"]) != (expect, expect_round) and not protocol.vouched(
            self._visible(), meta["round"], served
        ):
            return (
                f"its state of round {meta['round']} (hash {served}) is not what the swarm's peers report "
                f"(round {expect_round}, hash {expect or 'none'})"
            )
        adopted: verify.Reputation | None = None
        disputes: list[verify.Dispute] = []
        if self.verifying and reputation:  # trust and bans are the swarm's: newcomers judge as the swarm does
            if reputation_digest is not None:
                adopted, pending, problem = self._reputation_of_digest(
                    meta.get("reputation"), reputation_digest
                )
            else:
                adopted, pending, problem = self._backed_reputation(
                    meta.get("reputation"), donor, meta["round"]
                )
            if problem is not None:
                return problem
            # Taken by the lists alone, with disputes nobody vouched for: ours then differs from the swarm's
            # (we settle none of them), and our record says so by carrying no digest.
            self._reputation_backed = adopted is not None and pending is not None
            disputes = pending or []
        try:
            self.diloco.load_state_tensors(tensors, round=meta["round"])
        except ValueError as e:  # shapes or values that do not fit this model
            return str(e)
        if adopted is not None:
            # Bans the swarm's reputation does not hold are lifted (ours had drifted from it, say); our
            # averager's own refusals (a part it caught unsealed) stand.
            lifted = self.reputation.banned - adopted.banned
            self.reputation = adopted
            self.disputes = disputes  # of the round before: settled at this round's verdict
            if lifted:
                self.averager.unban(sorted(lifted))
            if adopted.banned:
                self.averager.ban(sorted(adopted.banned))
        return None

    def _backed_reputation(
        self, saved: object, donor: str, round: int
    ) -> tuple[verify.Reputation | None, list[verify.Dispute] | None, str | None]:
        """A donor's reputation (its state's, of ``round``) if most of the swarm's records back it: one donor
        alone cannot make itself trusted or ban anyone. Returns (the reputation to take, or None: keep ours),
        the disputes of the round before to settle at this round's verdict (None: the donor had some that
        nobody vouched for), and why the donor is refused, if it is.

        The records of ``round`` carry a digest of the whole reputation they donate, counts under the trust
        threshold included: a donor that listed the same trusted peers could otherwise bring an accomplice a
        round from trust in our eyes alone, or hold an honest peer back, and our assignments would then differ
        from the swarm's. A donor that offers another than most of them carry (the donor counted with what it
        serves) is refused, and another asked. Where they agree on none (honest peers split evenly, say), or
        none carries one (a swarm of an older release, or all moved on), the lists of trusted, struck and
        banned peers must match, or we keep ours, and the disputes are not taken: only a digest vouches for
        them (a forged one could strike an honest peer in our eyes alone)."""
        offered, disputes = _offered(self.reputation, saved)
        others = [
            r for r in live(self._others()).values() if r.peer_id != donor and r.state != PeerState.LOADING
        ]
        digests = Counter(r.reputation for r in others if r.round == round and r.reputation)
        if digests:
            # The donor has its say too: honest peers split evenly (a restart, say) must not refuse every donor.
            mine = verify.Reputation.digest_of(verify.donated(offered, disputes))
            digests[mine] += 1
            swarms, count = digests.most_common(1)[0]
            if count * 2 > digests.total():
                if mine == swarms:
                    return offered, disputes, None
                return (
                    None,
                    [],
                    (
                        f"its reputation of round {round} is not the one {count} of {digests.total()} of the "
                        "swarm's records of that round carry"
                    ),
                )
        listing = offered.listed(MAX_LISTED)
        views = [{"trusted": r.trusted, "struck": r.struck, "banned": r.banned} for r in others]
        backers = sum(view == listing for view in views)
        if views and backers * 2 <= len(views):
            self.log.warning(
                "refused the donor's reputation: the swarm's records list other trusted, struck or banned peers",
                donor=donor[-8:],
                backers=backers,
                peers=len(views),
            )
            return None, [], None
        return offered, (None if disputes else []), None

    def _reputation_of_digest(
        self, saved: object, digest: str
    ) -> tuple[verify.Reputation | None, list[verify.Dispute] | None, str | None]:
        """A donor's reputation and its pending disputes if their digest is ``digest``, else why not (as
        :meth:`_backed_reputation` returns them)."""
        offered, disputes = _offered(self.reputation, saved)
        served = verify.Reputation.digest_of(verify.donated(offered, disputes))
        if served != digest:
            return (
                None,
                [],
                f"its reputation (digest {served}) is not the one most trusted peers carry ({digest})",
            )
        return offered, disputes, None

    def _reputation_digest(self) -> str:
        """The digest our record carries of the reputation we donate ("": ours is not backed by the swarm)."""
        if not self._reputation_backed:
            return ""
        return verify.Reputation.digest_of(self._reputation_at_step)

    def _reputation_as_of_step(self) -> dict:
        """Take the reputation as it is now as the one we donate with our round's state (at a round change),
        and the record field that says which it is."""
        self._reputation_at_step = verify.donated(self.reputation, self.disputes)
        if not self.verifying:
            return {}
        return {"reputation": self._reputation_digest()}

    def _donation(self) -> tuple[dict, list[torch.Tensor]]:
        """What a newcomer downloads from us: global params, outer momentum, round (a consistent snapshot),
        and in verifiable runs the swarm's reputation."""
        meta, tensors = donation(
            self.diloco.snapshot(), run_id=self.cfg.run.run_id, config_hash=self.cfg.training_hash()
        )
        if self.verifying:  # as of the snapshot's round (taken in this thread: never mid-update)
            meta["reputation"] = self._reputation_at_step
        return meta, tensors

    def save(self, name: Outcome | str) -> Path:
        """Checkpoint under ``checkpoint.dir``; a final model file leaves out the inner optimizer (2x the
        params, useless after the end)."""
        path = self.checkpoint_dir / (FILE_NAMES[name] if isinstance(name, Outcome) else name)
        checkpoint.save(
            path,
            self.model,
            self.diloco,
            self.cfg,
            peer_id=self.peer_id,
            # As of the saved round, as a donation is: the round's own verdict is judged again on resuming.
            swarm={**self.memory.to_dict(), "reputation": self._reputation_at_step},
            inner_optimizer=None if name in (Outcome.FINAL, Outcome.DIVERGED) else self.inner_opt,
            counters={
                "inner_steps_total": self.inner_steps_total,
                "samples_total": self.samples_total,
                "compute_ms": int(self.compute_s * 1000),
                "rounds_contributed": self.rounds_contributed,
            },
        )
        return path

    # --------------------------------------------------------------------------------- helpers

    def me(self) -> Me:
        return Me(
            self.peer_id,
            self.round,
            self.diloco.params_hash(),
            self.last_group_size,
            serves=not self.cfg.swarm.client_mode,
        )

    @property
    def numeric_class(self) -> str:
        """Where this peer computes, as verification compares replicas: device/dtype."""
        return f"{self.device.type}/{self.cfg.device.dtype}"

    def _numeric_class_of(self, peer: str, records: dict[str, ProgressRecord]) -> str:
        if peer == self.peer_id:
            return self.numeric_class
        r = records.get(peer)
        return r.numeric_class if r is not None and r.numeric_class else "?"

    def _no_claims(self) -> dict:
        """Record fields that clear a verifiable round's claims (a new round starts without any)."""
        if not self.verifying:
            return {}
        return dict(
            shard="",
            replicas=[],
            roster=[],
            roster_classes=[],
            seal="",
            digest="",
            nonce="",
            parts=b"",
            sketch=b"",
            verdict="",
        )

    def _others(self) -> dict[str, ProgressRecord]:
        """The other peers' records (left ones included). Every reading also reaches ``self.memory``, through
        the board's subscription."""
        return self._in_run(self.board.records())

    def _in_run(self, records: dict[str, ProgressRecord]) -> dict[str, ProgressRecord]:
        """Other peers' records that can be true: no round of this run is past ``outer.num_rounds``."""
        last, banned = self.cfg.outer.num_rounds, self.reputation.banned
        return {
            pid: r
            for pid, r in records.items()
            if pid != self.peer_id and r.round <= last and pid not in banned and pid not in self.refused
        }

    def _visible(self) -> dict[str, ProgressRecord]:
        """The other peers' records that the round's decisions look at (see ``SwarmMemory.visible``)."""
        return self.memory.visible(self._others(), self.round)

    def _remember(self, records: dict[str, ProgressRecord]) -> None:
        """Fed every reading of the records, the heartbeat's too: the swarm's progress is noticed while we train."""
        in_run = self._in_run(records)
        self.memory.observe(in_run, self.round, distrusted=records.keys() - in_run.keys())

    @property
    def _poll_s(self) -> float:
        # Records that change at once (state, round, params, claims) arrive within a push; the others with
        # the next heartbeat: waits that are not a barrier poll no faster than that.
        return self.cfg.swarm.heartbeat_s / 2

    @property
    def checkpoint_dir(self) -> Path:
        assert self.peer_dir is not None, "setup() claims it"
        return self.peer_dir.path


def _offered(ours: verify.Reputation, saved: object) -> tuple[verify.Reputation, list[verify.Dispute]]:
    """A donated reputation, under our settings (its counts; none of them where it is malformed), and the
    disputes pending with it."""
    offered = verify.Reputation(
        rounds_to_trust=ours.rounds_to_trust, strikes_to_ban=ours.strikes_to_ban, window=ours.window
    )
    offered.restore(saved)
    return offered, verify.Dispute.pending_of(saved)
