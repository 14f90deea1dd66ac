"""An in-memory swarm: N real Trainers in one process (threads), the DHT and the all-reduce faked in memory,
and an injector that fails a named peer at a named point (as torchft's ``EventInjector.fail_at``).

What is real: the Trainer, its round protocol, DiLoCo, the model, data, codec, checkpoints. What is fake:
the records board (a dict with expiry times) and the averager (groups form per round key within
``averaging.matchmaking_time_s``, as hivemind's do; the average goes through the same codec both ways).

A crash (:class:`Crash`) stops a peer dead, as SIGKILL would: its thread unwinds without a goodbye record
or a model file, its record stays until it expires, and it serves nothing from then on.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from hivemind.utils.crypto import RSAPrivateKey

from p2ptrain.aggregation import aggregator
from p2ptrain.compression import Layout, roundtrip, wire_parts
from p2ptrain.config import ExperimentConfig, load_config
from p2ptrain.diloco import AverageResult, AveragingFailed, tensors_hash
from p2ptrain.experiment import Experiment, ExperimentRecord, sign, verified
from p2ptrain.link import Link
from p2ptrain.records import PART_DIGEST_BYTES, PeerState, ProgressRecord
from p2ptrain.swarm import check_fields, with_group_cleared
from p2ptrain.trainer import RunResult, Trainer
from p2ptrain.verify import Sealed, Wire, sent_problem, sketch_layout, wire
from tests.conftest import ROOT

# Rounds of tens of milliseconds, timers of a fraction of a second: a whole swarm runs in seconds.
FAST = {
    "run": {"run_id": "mem"},
    "outer": {"num_rounds": 4},
    "averaging": {
        "matchmaking_time_s": 0.5,  # long enough for every peer past the barrier to arrive, on a busy machine
        "request_timeout_s": 0.25,
        "matchmaking_timeout_s": 0.75,
        "next_chunk_timeout_s": 0.25,
        "allreduce_timeout_s": 0.6,
        "barrier_timeout_s": 30.0,
    },
    "swarm": {
        "heartbeat_s": 0.1,
        "record_ttl_s": 1.0,
        "split_warning_s": 60.0,
        "linger_s": 4.0,
        "catch_up_timeout_s": 3.0,
        "state_download_timeout_s": 5.0,
    },
}


def fast_config(tmp_path: Path, name: str, **sections: dict[str, Any]) -> ExperimentConfig:
    """configs/tiny.yaml with fast timers and this peer's own checkpoint dir."""
    overrides: dict[str, Any] = {k: dict(v) for k, v in FAST.items()}
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    overrides.setdefault("checkpoint", {})["dir"] = str(tmp_path / name)
    return load_config(ROOT / "configs" / "tiny.yaml", overrides)


class Crash(BaseException):
    """An injected crash. A BaseException, so that no ``except Exception`` in the trainer swallows it."""


class Point(str, Enum):
    """Where the injector can fail a peer."""

    INNER = "inner"
    """In its inner phase of the round (right after it announced it)."""
    BARRIER = "barrier"
    """At the barrier, after its inner phase, before its record says so."""
    ALLREDUCE = "allreduce"
    """In the all-reduce, after it served its averaged part to one groupmate only: that one steps, the
    others' all-reduce fails."""
    ATTEMPT = "attempt"
    """At the start of an attempt at its round's all-reduce, past the barrier (its record says averaging):
    with ``delay_s``, a peer held up in an attempt, as one that a staller keeps waiting."""
    DONATE = "donate"
    """Serving a newcomer: it sends a truncated state (as hivemind does when a donor dies mid-stream),
    then dies."""
    FINISHED = "finished"
    """After it finished and wrote its final model, while it lingers."""


@dataclass
class Fault:
    peer: str | None  # None: whichever peer gets there first
    point: Point
    round: int | None  # None: the first time the peer reaches the point
    delay_s: float = 0.0  # > 0: the peer stalls this long instead of crashing
    until: Callable[[], bool] | None = None  # with delay_s: the stall ends as soon as this holds


class Cut:
    """The peers lose each other (a network outage, or a machine so loaded that every push times out): from
    when the first of them enters ``from_round`` until one of them reaches ``until_round``, each reads the
    others' records as they were when the cut began, and every all-reduce fails."""

    def __init__(self, from_round: int, until_round: int):
        self.from_round, self.until_round = from_round, until_round
        self.frozen: dict[str, ProgressRecord] | None = None  # the records when the cut began
        self.healed = False
        self._lock = threading.Lock()

    def on(self, rounds: list[int], records: dict[str, ProgressRecord]) -> bool:
        """Whether the cut holds, given every peer's round now (and the records, to freeze as it begins)."""
        with self._lock:
            if self.frozen is None and max(rounds, default=-1) >= self.from_round:
                self.frozen = dict(records)
            if self.frozen is not None and max(rounds, default=-1) >= self.until_round:
                self.healed = True
            return self.frozen is not None and not self.healed

    def seen_by(self, peer_id: str, records: dict[str, ProgressRecord]) -> dict[str, ProgressRecord]:
        assert self.frozen is not None
        own = {peer_id: records[peer_id]} if peer_id in records else {}
        return {**{p: r for p, r in self.frozen.items() if p != peer_id}, **own}


class Injector:
    """Fails (or stalls) a named peer at a named point, once."""

    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.fired: list[tuple[str, Point, int]] = []
        self.group_failures: set[int] = set()  # rounds whose all-reduce fails for every member
        self.member_failures: dict[tuple[str, int], float] = {}  # (peer, round): attempts left to fail
        self.refuse_donations: set[str] = set()  # peers that never serve their state
        # Peers whose next readings of the swarm (this many of them by the trainer) catch it mid-outer-step.
        self.split_reads: dict[str, int] = {}
        # Peers that send something else than their pseudo-gradient (a hostile insider): what they send.
        self.tamper: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        # The next state served, whoever serves it, as a hostile donor would change it (its checksum redone);
        # who served it goes to tampered_donors.
        self.tamper_donation: Callable[[dict, list], tuple[dict, list]] | None = None
        self.tampered_donors: list[str] = []
        # observer -> (peer, round): while the observer is at that round's barrier (averaging, its group not
        # yet said), it reads the peer as paused: a peer that turned ready as the barriers passed, which one
        # barrier saw and another did not wait for.
        self.unseen_at_barrier: dict[str, tuple[str, int]] = {}
        # observer -> {peer: numeric class}: the observer reads those peers' records with that class, as if
        # each had changed its class between the observer's read and the other peers' (a hostile insider).
        self.misread_class: dict[str, dict[str, str]] = {}
        self.cut: Cut | None = None

    def fail_at(self, peer: str | None, point: Point, round: int | None = None) -> None:
        self._faults.append(Fault(peer, point, round))

    def stall_at(
        self,
        peer: str | None,
        point: Point,
        round: int | None,
        seconds: float,
        until: Callable[[], bool] | None = None,
    ) -> None:
        """``peer`` stalls ``seconds`` at ``point``; with ``until``, only until that holds (``seconds`` then
        caps the wait: a condition that never comes turns into a slow test, not a hang)."""
        self._faults.append(Fault(peer, point, round, delay_s=seconds, until=until))

    def fail_allreduce(self, round: int, peer: str | None = None, attempts: float = float("inf")) -> None:
        """The all-reduce of ``round`` fails for ``peer`` (its next ``attempts`` ones), or for everyone (all)."""
        if peer is None:
            self.group_failures.add(round)
        else:
            self.member_failures[(peer, round)] = attempts

    def member_fails(self, peer: str, round: int) -> bool:
        with self._lock:
            left = self.member_failures.get((peer, round), 0)
            if left > 0:
                self.member_failures[(peer, round)] = left - 1
            return left > 0

    def seen_by(
        self, peer: str, records: dict[str, ProgressRecord], *, trainer: bool
    ) -> dict[str, ProgressRecord]:
        """What ``peer`` reads of ``records``: with :attr:`split_reads` pending, the swarm as it is while two
        groupmates straddle an outer step (the first has published its next round, the other not yet).
        Only the trainer's readings count down, so that its decisions, not the heartbeat's, meet the split."""
        with self._lock:
            left = self.split_reads.get(peer, 0)
            if left <= 0:
                return records
            if trainer:
                self.split_reads[peer] = left - 1
        holders = [r for r in records.values() if r.holds_params]
        if not holders:
            return records
        first = max(holders, key=lambda r: (r.round, r.peer_id))
        return {
            **records,
            first.peer_id: first.copy(update={"round": first.round + 1, "params_hash": "f" * 16}),
        }

    def take(self, peer: str, point: Point, round: int) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.peer in (None, peer) and fault.point == point and fault.round in (None, round):
                    self._faults.remove(fault)
                    self.fired.append((peer, point, round))
                    return fault
        return None


class _Peer:
    """The swarm's side of one connected peer: its status, its state provider, whether it is alive."""

    def __init__(
        self, swarm: MemorySwarm, name: str, cfg: ExperimentConfig, layout: Layout, state_provider, stop
    ):
        self.swarm, self.name, self.cfg, self.layout = swarm, name, cfg, layout
        # Deterministic ids (the roster, and so the data shards, follow them): one per incarnation.
        self.peer_id = f"mem-{name}-{sum(p.name == name for p in swarm._peers.values())}"
        self.state_provider = state_provider
        self.stop = stop
        self.status: dict[str, Any] = dict(
            round=0,
            state=PeerState.LOADING,
            params_hash="",
            samples_round=0,
            samples_total=0,
            samples_per_s=0.0,
            last_group_size=0,
        )
        self.dead = threading.Event()  # crashed: its thread dies at its next call into the swarm
        self.gone = threading.Event()  # shut down (or crashed): serves nothing
        self.records_after_done = 0

    def check_alive(self) -> None:
        if self.dead.is_set():
            raise Crash(self.name)

    def kill(self) -> None:
        self.dead.set()
        self.gone.set()

    def hit(self, point: Point, round: int) -> None:
        fault = self.swarm.injector.take(self.name, point, round)
        if fault is None:
            return
        if fault.delay_s:
            if fault.until is None:
                time.sleep(fault.delay_s)
            else:
                deadline = time.monotonic() + fault.delay_s
                while not fault.until() and time.monotonic() < deadline:
                    time.sleep(0.01)
            self.check_alive()  # it may have been killed meanwhile (serving a download, say)
            return
        self.kill()
        raise Crash(f"{self.name} at {point.value} of round {round}")

    def record(self) -> ProgressRecord:
        serves = not self.cfg.swarm.client_mode
        return ProgressRecord(
            peer_id=self.peer_id, device="cpu", time=time.time(), serves=serves, **self.status
        )


@functools.cache
def _owner_key() -> RSAPrivateKey:
    """One signing key for every in-memory peer: an RSA key takes a while to make, and only signatures count."""
    return RSAPrivateKey()


class MemoryBoard:
    def __init__(self, peer: _Peer):
        self._peer = peer
        self.peer_id = peer.peer_id
        self._heartbeat: threading.Thread | None = None
        self._subscribers: list[Callable[[dict[str, ProgressRecord]], None]] = []

    def visible_maddrs(self) -> list[str]:
        return [f"/memory/{self.peer_id}"]

    def subscribe(self, observer) -> None:
        self._subscribers.append(observer)

    def start(self) -> None:
        self._heartbeat = threading.Thread(target=self._beat, name=f"beat-{self.peer_id}", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        # As swarm.Swarm's heartbeat: publish our record, and read everyone's (subscribers see it).
        while not self._peer.gone.wait(self._peer.cfg.swarm.heartbeat_s):
            self._peer.swarm.publish(self._peer)
            self._read()

    def update(self, **changes: Any) -> None:
        peer = self._peer
        peer.check_alive()
        if changes.get("state") == PeerState.AVERAGING:
            peer.hit(Point.BARRIER, peer.status["round"])  # before it says so: its record still says training
        check_fields(changes)  # as the real swarm does: a field it lacks is a crash there, not here only
        changes = with_group_cleared(changes, state=peer.status["state"], round=peer.status["round"])
        peer.status.update(changes)
        peer.swarm.publish(peer)
        state, round_ = peer.status["state"], peer.status["round"]
        # The inner phase's announcement (not the outer step's, which names the round; with outer.overlap,
        # while the previous round is averaged, it names no state).
        starts_inner = changes.get("state", PeerState.TRAINING) == PeerState.TRAINING
        if starts_inner and changes.get("samples_round") == 0 and "round" not in changes:
            if state == PeerState.AVERAGING:  # overlap: it trains the round after its record's
                round_ += 1
            peer.hit(Point.INNER, round_)
        elif state == PeerState.DONE:
            peer.records_after_done = 0

    def records(self) -> dict[str, ProgressRecord]:
        peer = self._peer
        peer.check_alive()
        if peer.status["state"] == PeerState.DONE:
            peer.records_after_done += 1
            if peer.records_after_done == 2:  # finish() read the swarm once and wrote final.safetensors
                peer.hit(Point.FINISHED, peer.status["round"])
        return self._read(trainer=True)

    def wait_for_news(self, timeout_s: float) -> None:
        self._peer.check_alive()
        self._peer.gone.wait(timeout_s)  # as a poll: the in-memory swarm keeps no versions

    def experiments(self) -> list[Experiment]:
        self._peer.check_alive()
        return self._peer.swarm.experiments()

    def sign_experiment(self, cfg: ExperimentConfig) -> ExperimentRecord:
        return sign(cfg, _owner_key())

    def carry_experiment(self, record: ExperimentRecord) -> None:
        self._peer.swarm.carry(self._peer.peer_id, record)

    def _read(self, *, trainer: bool = False) -> dict[str, ProgressRecord]:
        peer = self._peer
        records = peer.swarm.injector.seen_by(peer.name, peer.swarm.read(), trainer=trainer)
        if peer.swarm.cut_holds():
            records = peer.swarm.injector.cut.seen_by(peer.peer_id, records)  # type: ignore[union-attr]
        unseen = peer.swarm.injector.unseen_at_barrier.get(peer.name)
        status = peer.status
        if unseen is not None and status["round"] == unseen[1] and status["state"] == PeerState.AVERAGING:
            hidden = records.get(peer.swarm.peer_id(unseen[0]))
            if not status.get("group") and hidden is not None and hidden.round == unseen[1]:
                records = {**records, hidden.peer_id: hidden.copy(update={"state": PeerState.PAUSED})}
        if misread := peer.swarm.injector.misread_class.get(peer.name):  # of peers connected by now
            names = {pid: p.name for pid, p in list(peer.swarm._peers.items())}
            records = {
                pid: r.copy(update={"numeric_class": misread[names[pid]]}) if names.get(pid) in misread else r
                for pid, r in records.items()
            }
        for observe in self._subscribers:  # as swarm.Swarm: every reading reaches its subscribers
            observe(records)
        return records

    def shutdown(self) -> None:
        peer = self._peer
        if not peer.dead.is_set() and not peer.gone.is_set():
            peer.status["state"] = PeerState.LEFT
            peer.swarm.publish(peer)
        peer.gone.set()


class MemoryAverager:
    def __init__(self, peer: _Peer, layout: Layout):
        self._peer, self._layout = peer, layout
        self._expected: int | None = None

    def average(self, tensors, *, weight: float, round: int, attempts: int | None = None) -> AverageResult:
        peer = self._peer
        with peer.swarm._lock:
            peer.swarm.expected_groups.append((peer.peer_id, round, self._expected))
        self._expected = None
        cfg = peer.cfg.averaging
        errors = []
        for attempt in range(1 + cfg.retries if attempts is None else attempts):
            peer.check_alive()
            peer.hit(Point.ATTEMPT, round)
            try:
                tamper = peer.swarm.injector.tamper.get(peer.name, lambda t: t)
                tampered = [tamper(t) for t in tensors]
                # What the wire carries, as the real averager sends it: packed, cut, keyed by wire tensor.
                flats = self._layout.pack(tampered)
                sealed = wire(flats, self._layout.codec, self._layout.part_size_bytes)
                return peer.swarm.allreduce(peer, sealed.parts, weight, round, sealed)
            except AveragingFailed as e:
                if e.reason == "stopped":
                    raise
                errors.append(f"attempt {attempt + 1}: {e}")
                with peer.swarm._lock:
                    key = (peer.name, round)
                    peer.swarm.failed_attempts[key] = peer.swarm.failed_attempts.get(key, 0) + 1
        reason = "no_group" if all("no_group" in e for e in errors) else "allreduce"
        raise AveragingFailed(reason, "; ".join(errors))

    def download_state(self, donors, timeout: float):
        self._peer.check_alive()
        for donor_id in donors:
            if self._peer.peer_id in self._peer.swarm.refused_by(donor_id):
                continue  # as ExactAverager.rpc_download_state: a banned peer is served nothing
            got = self._peer.swarm.donate(donor_id)
            if got is not None:
                return (donor_id, *got)
        return None

    def expect_group(self, peers, round: int, clients=()) -> None:
        self._expected = len(peers)
        self._peer.swarm.named_clients[(self._peer.peer_id, round)] = sorted(clients)
        self._peer.swarm.named_groups[(self._peer.peer_id, round)] = sorted(peers)

    def leave_out(self, peers, round: int, weights=None, sealed=None) -> None:
        with self._peer.swarm._lock:
            self._peer.swarm.left_out.setdefault((self._peer.peer_id, round), set()).update(peers)
            if weights:
                self._peer.swarm.verdict_weights[(self._peer.peer_id, round)] = dict(weights)
            if sealed:
                self._peer.swarm.sealed[(self._peer.peer_id, round)] = dict(sealed)

    def ban(self, peers) -> None:
        with self._peer.swarm._lock:
            self._peer.swarm.banned_by.setdefault(self._peer.peer_id, set()).update(peers)

    def unban(self, peers) -> None:
        with self._peer.swarm._lock:
            self._peer.swarm.banned_by.get(self._peer.peer_id, set()).difference_update(peers)

    def left_out_of(self, peers, round: int) -> list[str]:
        swarm, me = self._peer.swarm, self._peer.peer_id
        with swarm._lock:
            out = swarm.left_out.get((me, round), set()) | swarm.refused_by(me)
            verdict = swarm.verdict_weights.get((me, round))
        return sorted(p for p in peers if p in out or (verdict is not None and p != me and p not in verdict))

    def shutdown(self) -> None:
        pass


@dataclass
class _Group:
    round: int
    closes_at: float
    target: int
    members: list[tuple[_Peer, list[torch.Tensor], float]] = field(default_factory=list)
    wires: dict[str, Wire] = field(default_factory=dict)
    """What each member sent, as its reducers receive it (parts and their digests)."""
    closed: threading.Event = field(default_factory=threading.Event)
    results: dict[str, AverageResult | AveragingFailed] = field(default_factory=dict)


def _returned(layout: Layout, average: list[torch.Tensor]) -> list[torch.Tensor]:
    """The pseudo-gradient a member takes from the averaged parts: as hivemind's reducers send them back,
    through the wire codec, put back into the wire tensors and unpacked."""
    metas = [torch.empty(s, device="meta") for s in layout.wire_shapes]
    infos = [info for _, info in wire_parts(metas, layout.codec, layout.part_size_bytes)]
    flats: list[list[torch.Tensor]] = [[] for _ in layout.wire_shapes]
    for part, info in zip(average, infos, strict=True):
        flats[info.key].append(roundtrip(layout.codec, part, info))
    return layout.unpack([torch.cat(f).view(s) for f, s in zip(flats, layout.wire_shapes, strict=True)])


class MemorySwarm:
    """The DHT and the all-reduce of one run, in memory. ``connect(name)`` is a Trainer's ``connect``."""

    def __init__(self, injector: Injector | None = None):
        self.injector = injector or Injector()
        self._store: dict[str, tuple[ProgressRecord, float]] = {}
        self._forged_states: dict[str, tuple[Any, list[torch.Tensor]]] = {}
        self.forged_downloads = 0
        self._peers: dict[str, _Peer] = {}
        self._groups: dict[int, _Group] = {}
        self.left_out: dict[tuple[str, int], set[str]] = {}
        """(peer, round) -> whom that peer refuses to average with in that round (a verdict)."""
        self.verdict_weights: dict[tuple[str, int], dict[str, float]] = {}
        """(peer, round) -> the weight each groupmate counts with by that peer's verdict (never its claim)."""
        self.banned_by: dict[str, set[str]] = {}
        """peer -> whom it banned (the swarm's reputation): never averaged with, never served, until lifted."""
        self.caught_by: dict[str, set[str]] = {}
        """peer -> whom its reducer caught sending something else than it sealed: left out for good."""
        self.expected_groups: list[tuple[str, int, int | None]] = []
        """(peer, round, size) of every all-reduce a peer began: the group size it told its averager to
        expect (``expect_group``), None if it told none."""
        self.named_clients: dict[tuple[str, int], list[str]] = {}
        """(peer, round) -> the members in client mode that peer named to its averager (``expect_group``)."""
        self.named_groups: dict[tuple[str, int], list[str]] = {}
        """(peer, round) -> the group that peer named to its averager (``expect_group``)."""
        self.failed_attempts: dict[tuple[str, int], int] = {}
        """(peer name, round) -> how many of that peer's attempts at the round's all-reduce failed."""
        self.averaged: list[tuple[int, list[str]]] = []
        """(round, the members whose parts made the average) of every all-reduce that produced one."""
        self.sealed: dict[tuple[str, int], dict[str, Sealed]] = {}
        """(peer, round) -> what each groupmate sealed about its parts, by that peer's verdict."""
        self.weights: dict[tuple[str, int], float] = {}
        """(peer, round) -> the weight that peer joined the round's all-reduce with."""
        self._carried: dict[str, ExperimentRecord] = {}
        """peer -> the experiment it carries (as under its subkey of p2ptrain_experiments)."""
        self._lock = threading.Condition()

    def refused_by(self, peer_id: str) -> set[str]:
        """Whom ``peer_id`` never averages with nor serves: those it banned, and those its reducer caught."""
        return self.banned_by.get(peer_id, set()) | self.caught_by.get(peer_id, set())

    # --- the board
    def carry(self, peer_id: str, record: ExperimentRecord) -> None:
        with self._lock:
            self._carried[peer_id] = record

    def experiments(self) -> list[Experiment]:
        with self._lock:
            carried = dict(self._carried)
        by_record: dict[str, tuple[ExperimentRecord, set[str]]] = {}
        for peer_id, record in carried.items():
            by_record.setdefault(record.json(), (record, set()))[1].add(peer_id)
        found = (verified(record, frozenset(peers)) for record, peers in by_record.values())
        return [e for e in found if e is not None]

    def publish(self, peer: _Peer) -> None:
        with self._lock:
            if peer.dead.is_set() or (peer.gone.is_set() and peer.status["state"] != PeerState.LEFT):
                return
            self._store[peer.peer_id] = (peer.record(), time.monotonic() + peer.cfg.swarm.record_ttl_s)

    def forge(
        self, record: ProgressRecord, ttl_s: float, state: tuple[Any, list[torch.Tensor]] | None = None
    ) -> None:
        """A hostile identity's record (and the state it serves to whoever asks it), as an insider can publish
        them: under its own identity only, since records are bound to their signer."""
        with self._lock:
            self._store[record.peer_id] = (record, time.monotonic() + ttl_s)
            if state is not None:
                self._forged_states[record.peer_id] = state

    def read(self) -> dict[str, ProgressRecord]:
        now = time.monotonic()
        with self._lock:
            return {pid: r for pid, (r, expires) in self._store.items() if expires > now}

    def cut_holds(self) -> bool:
        """Whether the injector's :class:`Cut` keeps the peers apart now."""
        cut = self.injector.cut
        if cut is None or cut.healed:
            return False
        with self._lock:
            peers = list(self._peers.values())
            records = {pid: r for pid, (r, _) in self._store.items()}
        return cut.on([p.status["round"] for p in peers], records)

    # --- the all-reduce
    def allreduce(
        self, peer: _Peer, parts: list[torch.Tensor], weight: float, round: int, sent: Wire
    ) -> AverageResult:
        """``parts``: the decoded parts ``peer`` sends (its ``sent`` wire's), which the group aggregates."""
        cfg = peer.cfg.averaging
        if self.cut_holds():
            raise AveragingFailed("cut", "the peers lost each other")
        with self._lock:
            group = self._groups.get(round)
            if group is None or group.closed.is_set():
                group = self._groups[round] = _Group(
                    round, time.monotonic() + cfg.matchmaking_time_s, cfg.target_group_size
                )
            group.members.append((peer, parts, weight))
            self.weights[(peer.name, round)] = weight
            group.wires[peer.peer_id] = sent
            if len(group.members) >= group.target or self._everyone_ready_is_in(group):
                self._close(group, cfg.min_group_size)
        while not group.closed.wait(0.01):
            if peer.stop.is_set():
                raise AveragingFailed("stopped", "stop requested")
            if peer.dead.is_set():
                raise Crash(peer.name)
            with self._lock:
                if not group.closed.is_set() and time.monotonic() >= group.closes_at:
                    self._close(group, cfg.min_group_size)
        result = group.results[peer.peer_id]
        if peer.dead.is_set():
            raise Crash(f"{peer.name} in the all-reduce of round {round}")
        if isinstance(result, AveragingFailed):
            self._learn_late(peer, group, deadline=time.monotonic() + cfg.allreduce_timeout_s)
            raise result
        return result

    def _learn_late(self, peer: _Peer, group: _Group, deadline: float) -> None:
        """A member whose all-reduce fails while groupmates got the average learns it late, as with hivemind
        (it waits out a groupmate's timeout; they step at once): only after they have published their step.
        Without this, which of the two comes first would be up to the thread scheduler."""
        lucky = [m for m, _, _ in group.members if not isinstance(group.results[m.peer_id], AveragingFailed)]
        while time.monotonic() < deadline and not peer.stop.is_set():
            if all(m.status["round"] > group.round or m.gone.is_set() for m in lucky):
                return
            time.sleep(0.01)

    def _everyone_ready_is_in(self, group: _Group) -> bool:
        """Under the lock: every live peer whose record says it is past the barrier of this round has joined.

        hivemind waits out ``matchmaking_time_s`` unless ``target_group_size`` is reached; forming the group
        from the records instead keeps rounds short here (the timer still closes a group whose member died).
        """
        now = time.monotonic()
        ready = {
            pid
            for pid, (r, expires) in self._store.items()
            if expires > now and r.round == group.round and r.state == PeerState.AVERAGING
        }
        return ready <= {m[0].peer_id for m in group.members}

    def _sent_problem(self, reducer: _Peer, member, group: _Group) -> str | None:
        """What ``reducer`` finds wrong with what ``member`` sent it (None: nothing, or no verdict to go by)."""
        peer, _, weight = member
        verdict = self.verdict_weights.get((reducer.peer_id, group.round), {})
        if peer.peer_id in verdict and verdict[peer.peer_id] != weight:
            return f"claims weight {weight}, the verdict gives it {verdict[peer.peer_id]}"
        table = self.sealed.get((reducer.peer_id, group.round))
        if table is None:
            return None
        if peer.peer_id not in table:
            return "sealed nothing"
        sent = group.wires[peer.peer_id]
        layout = sketch_layout([p.numel() for p in sent.parts])
        for i, part in enumerate(sent.parts):
            digest = sent.digests[i * PART_DIGEST_BYTES : (i + 1) * PART_DIGEST_BYTES]
            problem = sent_problem(table[peer.peer_id], i, digest, part, layout)
            if problem is not None:
                return problem
        return None

    def _close(self, group: _Group, min_group_size: int) -> None:
        """Under the lock: decide every member's outcome of this group's all-reduce."""
        members = sorted(group.members, key=lambda m: m[0].peer_id)
        # As hivemind's matchmaking with ExactAverager's refusals: a peer that a member left out of this round
        # finds no group (it may still come; a hostile one would).
        refused = set().union(
            *(self.left_out.get((m[0].peer_id, group.round), set()) for m in members),
            *(self.refused_by(m[0].peer_id) for m in members),
        )
        # As ExactAverager._left_out_now: a peer that a member's verdict does not count is refused too.
        verdicts = [v for m in members if (v := self.verdict_weights.get((m[0].peer_id, group.round)))]
        refused |= {m[0].peer_id for m in members if any(m[0].peer_id not in v for v in verdicts)}
        for m in [m for m in members if m[0].peer_id in refused]:
            group.results[m[0].peer_id] = AveragingFailed("no_group", "left out by its groupmates")
            members.remove(m)
        # As ExactAllReduceRunner's reducers: a sender whose weight is not the verdict's, or whose parts are
        # not what it sealed and sketched, is left out, and every groupmate that received them bans it.
        for m in list(members):
            problems = {
                other[0].peer_id: problem
                for other in members
                if other is not m and (problem := self._sent_problem(other[0], m, group)) is not None
            }
            if problems:
                group.results[m[0].peer_id] = AveragingFailed("allreduce", f"misbehaved: {problems}")
                members.remove(m)
                for reducer in problems:
                    self.caught_by.setdefault(reducer, set()).add(m[0].peer_id)
        ids = [m[0].peer_id for m in members]
        if len(members) < max(min_group_size, 2):
            for pid in ids:
                group.results[pid] = AveragingFailed("no_group", "could not find a group")
        else:
            # The reducers' aggregate, part by part as hivemind cuts them (members send their decoded parts).
            aggregate = aggregator(members[0][0].cfg.averaging)
            if any(v != verdicts[0] for v in verdicts):  # would be a bug: honest peers judge alike
                for pid in ids:
                    group.results[pid] = AveragingFailed("allreduce", "groupmates' verdicts differ")
                group.closed.set()
                return
            verdict = verdicts[0] if verdicts else {}
            weights = [verdict.get(m.peer_id, w) for m, _, w in members]
            average = [
                aggregate([t[i] for _, t, _ in members], weights).tensor for i in range(len(members[0][1]))
            ]
            layout = members[0][0].layout  # every member decodes the same bytes: one result for all
            result = AverageResult(tensors=_returned(layout, average), group_size=len(members), peers=ids)
            for pid in ids:  # each with whom its own averager left out for good, as ExactAverager's LeftOut
                group.results[pid] = replace(result, refused=sorted(self.caught_by.get(pid, ())))
            self.averaged.append((group.round, list(ids)))
            dying = [m[0] for m in members if self.injector.take(m[0].name, Point.ALLREDUCE, group.round)]
            for victim in dying:
                victim.kill()
                # It served its averaged part to one groupmate only: that one has everything, the rest fail.
                lucky = next((pid for pid in ids if pid != victim.peer_id), None)
                for pid in ids:
                    if pid != lucky:
                        group.results[pid] = AveragingFailed("allreduce", f"{victim.name} left mid-way")
            if group.round in self.injector.group_failures:
                for pid in ids:
                    group.results[pid] = AveragingFailed(
                        "allreduce", "injected: the group's all-reduce failed"
                    )
            for peer, _, _ in members:
                if self.injector.member_fails(peer.name, group.round):
                    group.results[peer.peer_id] = AveragingFailed("allreduce", "injected: this member failed")
        group.closed.set()

    # --- state transfer
    def donate(self, donor_id: str) -> tuple[Any, list[torch.Tensor]] | None:
        if donor_id in self._forged_states:
            self.forged_downloads += 1
            return self._forged_states[donor_id]
        donor = self._peers.get(donor_id)
        if donor is None or donor.gone.is_set() or donor.name in self.injector.refuse_donations:
            return None
        if donor.cfg.swarm.client_mode:  # as hivemind's averager: allow_state_sharing = not client_mode
            return None
        metadata, tensors = donor.state_provider()
        with self._lock:
            tamper, self.injector.tamper_donation = self.injector.tamper_donation, None
        if tamper is not None:
            self.injector.tampered_donors.append(donor.peer_id)
            metadata, tensors = tamper(dict(metadata), list(tensors))
            metadata["state_hash"] = tensors_hash(tensors)  # a donor computes its own checksum
        if self.injector.take(donor.name, Point.DONATE, int(metadata["round"])):
            donor.kill()
            return metadata, tensors[: len(tensors) // 2]  # what hivemind hands over from a dead donor
        return metadata, tensors

    # --- peers
    def connect(self, name: str) -> Callable[..., Link]:
        def _connect(cfg, *, device, layout, state_provider, stop) -> Link:
            peer = _Peer(self, name, cfg, layout, state_provider, stop)
            with self._lock:
                self._peers[peer.peer_id] = peer
            return Link(MemoryBoard(peer), MemoryAverager(peer, layout))

        return _connect

    def peer_id(self, name: str) -> str:
        """The id of the newest incarnation of peer ``name``."""
        return [pid for pid, p in self._peers.items() if p.name == name][-1]

    def name_of(self, peer_id: str) -> str:
        return self._peers[peer_id].name


class PeerThread:
    """A Trainer running in a thread; ``result`` is its RunResult, or the Crash that ended it."""

    started: list[PeerThread] = []  # every one, so that a fixture can stop those a failed test left running

    def __init__(
        self, swarm: MemorySwarm, name: str, cfg: ExperimentConfig, trainer_cls: type[Trainer] = Trainer
    ):
        PeerThread.started.append(self)
        self.name, self.cfg = name, cfg
        self.stop = threading.Event()
        self.trainer = trainer_cls(cfg, stop=self.stop, connect=swarm.connect(name))
        self.result: RunResult | BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"trainer-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self.trainer.run()
        except BaseException as e:  # a Crash, or a bug the test reports
            self.result = e

    def join(self, timeout_s: float = 120) -> RunResult | BaseException | None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"{self.name} still running after {timeout_s}s"
        return self.result

    @property
    def crashed(self) -> bool:
        return isinstance(self.result, Crash)

    def wait_until(self, predicate: Callable[[Trainer], bool], timeout_s: float = 60) -> None:
        """Poll a condition on the trainer (never a timing assertion: a deadline only turns a hang into a failure)."""

        def holds() -> bool:
            try:
                return predicate(self.trainer)
            except AttributeError:  # still setting up
                return False

        deadline = time.monotonic() + timeout_s
        while not holds():
            assert self._thread.is_alive() or holds(), f"{self.name} ended: {self.result!r}"
            assert time.monotonic() < deadline, f"{self.name}: condition not met within {timeout_s}s"
            time.sleep(0.01)

    @classmethod
    def stop_all(cls) -> None:
        for p in cls.started:
            p.stop.set()
        for p in cls.started:
            p._thread.join(30)
        cls.started.clear()
