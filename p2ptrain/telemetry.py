"""Prometheus metrics: every metric p2ptrain exports is defined here, once.

Naming follows Prometheus conventions: the ``p2ptrain_`` prefix, base units (seconds, bytes),
``_total`` on counters (prometheus-client appends it), no label per remote peer (a swarm of a
thousand peers must not make a thousand series on each of them).

A peer (``p2ptrain join --metrics-port N``) exports its own training (:data:`PEER`) and the swarm as
it sees it; the bootstrap node (``p2ptrain dht --metrics-port N``) exports only swarm-wide gauges read
from the peers' signed DHT records (:data:`NODE`), so a swarm whose peers sit behind NATs can still be
watched from one place, and no dashboard query mixes a node that does not train into a peer's series
(it would show a validation loss of 0). :data:`REGISTRY` is a peer's whole set.
"""

from __future__ import annotations

import platform
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    gc_collector,
    platform_collector,
    process_collector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from p2ptrain.config import ConfigError
from p2ptrain.logs import get_logger
from p2ptrain.records import PeerState, ProgressRecord, global_round

if TYPE_CHECKING:
    from p2ptrain.diloco import OuterStepReport
    from p2ptrain.verify import Reputation, RoundVerdict

NODE = CollectorRegistry(auto_describe=True)
"""What every process exports: process, platform and GC series, who it is, the swarm as it sees it."""
PEER = CollectorRegistry(auto_describe=True)
"""A training peer's own series."""
process_collector.ProcessCollector(registry=NODE)
platform_collector.PlatformCollector(registry=NODE)
gc_collector.GCCollector(registry=NODE)


class _Union:
    """A collector of several registries' metrics (prometheus-client serves one registry)."""

    def __init__(self, *registries: CollectorRegistry):
        self.registries = registries

    def collect(self):
        for registry in self.registries:
            yield from registry.collect()


REGISTRY = CollectorRegistry(auto_describe=True)
"""What a peer serves: :data:`NODE` and :data:`PEER`."""
REGISTRY.register(_Union(NODE, PEER))  # type: ignore[arg-type]

# A round is an inner phase of seconds to tens of minutes plus an all-reduce: buckets from 1 s to 1 h.
ROUND_BUCKETS = (1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# One inner step: milliseconds on a GPU, seconds on a laptop CPU.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
FAILURE_REASONS = ("no_group", "allreduce", "rejected", "non_finite", "stale")
"""Why a round's outer step did not average with the swarm (see DiLoCo.sync and Trainer.barrier)."""

# --------------------------------------------------------------------------------------- a peer
INNER_STEPS = Counter(
    "p2ptrain_inner_steps",
    "Inner optimizer steps taken by this peer (counted as they happen).",
    registry=PEER,
)
INNER_STEP_DURATION = Histogram(
    "p2ptrain_inner_step_duration_seconds",
    "Wall time of one inner step (forward, backward, optimizer), measured per round as its mean.",
    buckets=STEP_BUCKETS,
    registry=PEER,
)
INNER_SECONDS = Counter(
    "p2ptrain_inner_phase_seconds",
    "Seconds this peer spent in inner phases: the compute it gave the run.",
    registry=PEER,
)
WAIT_SECONDS = Counter(
    "p2ptrain_round_wait_seconds",
    "Seconds this peer spent in a round outside its inner phase, by phase: barrier (waiting for the round's "
    "other peers), verify (a verifiable round's reveal and verdict), sync (matchmaking, all-reduce, outer "
    "step), eval (validation in the training thread; one in the background is no wait). Utilization = inner "
    "phase seconds over all of them.",
    ["phase"],
    registry=PEER,
)
WAIT_PHASES = ("barrier", "verify", "sync", "eval")
STEPS_WHILE_WAITING = Counter(
    "p2ptrain_inner_steps_while_waiting",
    "With inner.max_steps_while_waiting: inner steps taken past a round's H while its slower peers finished "
    "theirs (also in p2ptrain_inner_steps).",
    registry=PEER,
)
STALE_STEPS = Gauge(
    "p2ptrain_stale_inner_steps",
    "With outer.overlap: the inner steps of this round taken from the local params before the last round's "
    "average landed (carried over onto the new params).",
    registry=PEER,
)
DEVICE_SAMPLES_PER_SECOND = Gauge(
    "p2ptrain_device_benchmark_samples_per_second",
    "This peer's device speed at the run's model, measured at start (device.benchmark_steps).",
    registry=PEER,
)
DEVICE_FLOPS = Gauge(
    "p2ptrain_device_benchmark_flops",
    "The same in FLOP/s, estimated as 6 x params x tokens per second (a CNN: its weights x positions).",
    registry=PEER,
)
OUTER_STEPS = Counter("p2ptrain_outer_steps", "Outer steps this peer applied.", registry=PEER)
OUTER_STEP_DURATION = Histogram(
    "p2ptrain_outer_step_duration_seconds",
    "Wall time of a whole round: inner phase, barrier, all-reduce and outer step.",
    buckets=ROUND_BUCKETS,
    registry=PEER,
)
SYNC_DURATION = Histogram(
    "p2ptrain_outer_sync_duration_seconds",
    "Wall time of a round's outer sync: matchmaking, all-reduce and outer step (barrier excluded).",
    buckets=ROUND_BUCKETS,
    registry=PEER,
)
OUTER_STEP_FAILURES = Counter(
    "p2ptrain_outer_step_failures",
    "Rounds whose pseudo-gradient did not enter a swarm average, by reason.",
    ["reason"],
    registry=PEER,
)
TRAIN_LOSS = Gauge("p2ptrain_train_loss", "Mean training loss of the last inner phase.", registry=PEER)


class _Reading:
    """A gauge that is absent until it has a value: a reading a peer takes now and then (its validation loss,
    when its turn comes: data.eval_by) must not show as 0 before the first one (a dashboard's min() would
    pick it)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.value: float | None = None
        registry.register(self)  # type: ignore[arg-type]  # a collector: it has collect()

    def set(self, value: float) -> None:
        self.value = float(value)

    def collect(self):
        if self.value is not None:
            yield GaugeMetricFamily(self.name, self.documentation, value=self.value)


VALIDATION_LOSS = _Reading(
    "p2ptrain_validation_loss",
    "Validation loss of the global params after the last outer step this peer evaluated (data.eval_by).",
    PEER,
)
SAMPLES = Counter("p2ptrain_samples", "Training samples (sequences) processed by this peer.", registry=PEER)
SAMPLES_PER_SECOND = Gauge(
    "p2ptrain_samples_per_second", "This peer's inner-phase throughput in the last round.", registry=PEER
)
AVERAGING_SENT = Counter(
    "p2ptrain_averaging_sent_bytes", "All-reduce payload bytes this peer sent.", registry=PEER
)
AVERAGING_RECEIVED = Counter(
    "p2ptrain_averaging_received_bytes", "All-reduce payload bytes this peer received.", registry=PEER
)
GROUP_SIZE = Gauge(
    "p2ptrain_averaging_group_size",
    "Peers in this peer's last all-reduce group (1: it stepped alone).",
    registry=PEER,
)
OUTLIER_PARTS = Counter(
    "p2ptrain_averaging_outlier_parts",
    "Parts of groupmates' pseudo-gradients that this peer's reducer left out of the aggregate (far beyond "
    "the others' spread: averaging.reject_radius).",
    registry=PEER,
)
VERIFIED_GROUPS = Counter(
    "p2ptrain_verification_groups",
    "Replica groups of verifiable rounds that this peer judged, by outcome: agree (their work counts) or "
    "dissent (the whole group is left out of the round).",
    ["outcome"],
    registry=PEER,
)
LEFT_OUT_PEERS = Counter(
    "p2ptrain_verification_left_out",
    "Peers that this peer left out of a verifiable round's average, by why (verify.Why: dissent, unmatched, "
    "unrevealed, misassigned, banned).",
    ["reason"],
    registry=PEER,
)
TRUSTED_PEERS = Gauge(
    "p2ptrain_verification_trusted_peers",
    "Peers this peer counts as trusted (verification.rounds_to_trust rounds in agreement).",
    registry=PEER,
)
BANNED_PEERS = Gauge("p2ptrain_verification_banned_peers", "Peers banned from the run.", registry=PEER)
CONVICTIONS = Counter(
    "p2ptrain_verification_convictions",
    "Strikes against peers: a referee's recomputation of a dissenting group's shard disagreed with them.",
    registry=PEER,
)
SPLIT_VERDICTS = Counter(
    "p2ptrain_verification_split_verdicts",
    "Verifiable rounds in which a peer this peer judged published another verdict than its own: they read "
    "other claims (a key holder can show each peer another record).",
    registry=PEER,
)
REALIGNMENTS = Counter(
    "p2ptrain_verification_realignments",
    "Times this peer took the reputation most trusted peers of its round carry, its own having drifted.",
    registry=PEER,
)
ROUND = Gauge("p2ptrain_round", "The outer round this peer is in.", registry=PEER)
PAUSED = Gauge(
    "p2ptrain_paused", "1 while this peer's schedule has it paused (its machine comes first).", registry=PEER
)
STATE_LOADS = Counter(
    "p2ptrain_state_loads", "Swarm states this peer downloaded from other peers.", registry=PEER
)
PEER_INFO = Info("p2ptrain_peer", "This process: peer id, run, device, versions.", registry=NODE)

# ---------------------------------------------------------- the swarm, as this process sees it
SWARM_PEERS = Gauge(
    "p2ptrain_swarm_peers",
    "Live peers of the run (records not expired), by state.",
    ["state"],
    registry=NODE,
)
SWARM_ROUND = Gauge(
    "p2ptrain_swarm_round", "The swarm's round: the highest round of a live peer.", registry=NODE
)
SWARM_SAMPLES_PER_SECOND = Gauge(
    "p2ptrain_swarm_samples_per_second", "Sum of the live peers' reported throughput.", registry=NODE
)
SWARM_SAMPLES = Gauge(
    "p2ptrain_swarm_samples",
    "Sum of the live peers' samples processed since each started (peers that left are not counted).",
    registry=NODE,
)

PEER_STATES = tuple(s.value for s in PeerState if s != PeerState.LEFT)

for _reason in FAILURE_REASONS:  # every series exists from the start, at 0, so rate() and alerts work
    OUTER_STEP_FAILURES.labels(reason=_reason)
for _phase in WAIT_PHASES:
    WAIT_SECONDS.labels(phase=_phase)
for _outcome in ("agree", "dissent"):
    VERIFIED_GROUPS.labels(outcome=_outcome)
for _why in ("dissent", "unmatched", "unrevealed", "misassigned", "banned"):
    LEFT_OUT_PEERS.labels(reason=_why)
for _state in PEER_STATES:
    SWARM_PEERS.labels(state=_state)


def serve(port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> None:
    """Serve ``registry`` at /metrics on ``host:port`` from a daemon thread (a peer: :data:`REGISTRY`; the
    bootstrap node: :data:`NODE`). Start it after hivemind's children have forked (a forked child would
    inherit the listening socket).

    Raises:
        ConfigError: nothing can listen there (the port is taken, the host is not this machine's).
    """
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as e:  # socket.gaierror too: a host that does not resolve
        fix = "set metrics.host" if isinstance(e, socket.gaierror) else "pick another with --metrics-port"
        raise ConfigError(
            f"metrics.port {port} on metrics.host {host}: cannot serve metrics there ({e.strerror or e}); {fix}"
        ) from None


def set_peer_info(**fields: str) -> None:
    import hivemind  # noqa: I001 - here: importing hivemind takes seconds, which a metrics import should not
    import torch

    PEER_INFO.info(
        {
            **fields,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hivemind": hivemind.__version__,
        }
    )


def observe_stale_steps(steps: int) -> None:
    """An overlapped sync landed after ``steps`` inner steps of the next round."""
    STALE_STEPS.set(steps)


def observe_benchmark(samples_per_s: float, flops: float) -> None:
    DEVICE_SAMPLES_PER_SECOND.set(samples_per_s)
    DEVICE_FLOPS.set(flops)


def observe_inner_phase(*, steps: int, samples: int, seconds: float, loss: float) -> None:
    """A round's inner phase ended (its steps were counted as they happened)."""
    SAMPLES.inc(samples)
    INNER_SECONDS.inc(seconds)
    if steps:
        INNER_STEP_DURATION.observe(seconds / steps)
        TRAIN_LOSS.set(loss)
        SAMPLES_PER_SECOND.set(samples / max(seconds, 1e-9))


def observe_outer_step(
    report: OuterStepReport,
    *,
    round: int,
    duration_s: float,
    phases: dict[str, float],
    val_loss: float | None,
) -> None:
    """A round ended with this outer step (``round``: the peer's round now). ``phases``: seconds by
    ``WAIT_PHASES``; ``val_loss``: None when a groupmate evaluated the round (``data.eval_by``)."""
    if report.applied:
        OUTER_STEPS.inc()
    if report.failure in FAILURE_REASONS:
        OUTER_STEP_FAILURES.labels(reason=report.failure).inc()
    OUTER_STEP_DURATION.observe(duration_s)
    SYNC_DURATION.observe(phases["sync"])
    for phase in WAIT_PHASES:
        WAIT_SECONDS.labels(phase=phase).inc(phases.get(phase, 0.0))
    AVERAGING_SENT.inc(report.bytes_sent)
    AVERAGING_RECEIVED.inc(report.bytes_received)
    OUTLIER_PARTS.inc(sum(report.outliers.values()))
    GROUP_SIZE.set(report.group_size)
    if val_loss is not None:
        VALIDATION_LOSS.set(val_loss)
    ROUND.set(round)


def observe_verdict(verdict: RoundVerdict, reputation: Reputation) -> None:
    """A verifiable round was judged (``verify.judge_round``)."""
    VERIFIED_GROUPS.labels(outcome="agree").inc(len(verdict.agreed))
    VERIFIED_GROUPS.labels(outcome="dissent").inc(len(verdict.dissent))
    for why in verdict.left_out.values():
        LEFT_OUT_PEERS.labels(reason=why.value).inc()
    _observe_reputation(reputation)


def observe_convictions(convicted: list[str], banned: set[str], reputation: Reputation) -> None:
    """A referee's report was read: ``convicted`` got a strike, ``banned`` are banned from now on."""
    CONVICTIONS.inc(len(convicted))
    _observe_reputation(reputation)


def _observe_reputation(reputation: Reputation) -> None:
    TRUSTED_PEERS.set(sum(reputation.trusted(p) for p in reputation.agreed))
    BANNED_PEERS.set(len(reputation.banned))


def observe_swarm(records: dict[str, ProgressRecord]) -> None:
    """Set the swarm-wide gauges from live progress records (by peer id)."""
    for state in PEER_STATES:
        SWARM_PEERS.labels(state=state).set(sum(1 for r in records.values() if r.state == state))
    SWARM_ROUND.set(max(global_round(records), 0))
    SWARM_SAMPLES_PER_SECOND.set(
        sum(r.samples_per_s for r in records.values() if r.state in (PeerState.TRAINING, PeerState.AVERAGING))
    )
    SWARM_SAMPLES.set(sum(r.samples_total for r in records.values()))


class SwarmMonitor:
    """Refreshes the swarm-wide gauges from the DHT every ``period_s`` (the bootstrap node runs one)."""

    def __init__(self, read_records: Callable[[], dict], period_s: float):
        self._read, self._period = read_records, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="swarm-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        log = get_logger(__name__)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                observe_swarm(self._read())
            except Exception as e:  # a DHT hiccup: keep the last values, try again next period
                log.warning("could not read the swarm's records", error=repr(e))
            self._stop.wait(max(0.0, self._period - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
