"""The swarm as a peer sees it: a hivemind DHT, signed progress records, and the round they agree on.

There is no coordinator. Each peer stores a small signed record under ``{run_id}_progress`` (one
subkey per peer, signed with the peer's RSA key so nobody can overwrite another's record) and
refreshes it every ``swarm.heartbeat_s`` from a background thread. A record older than
``swarm.record_ttl_s`` expires: that peer is gone. Everything a peer decides about the swarm
(the global round, who to wait for, whose state is canonical) is a pure function of the live
records, in :func:`global_round` and :func:`canonical_hash`.

Each record also carries the peer's *view*: a short hash of the set of live peers it sees. Peers of a
healthy swarm see the same set within a few heartbeats. :class:`SplitWatch` warns when they have not
for ``swarm.split_warning_s`` (or their rounds stay two or more apart): the DHT is split, or some
peers cannot reach others. A complete split, where no peer sees both sides, cannot be noticed from
inside; ``p2ptrain status`` against each bootstrap node shows it.

Process model: the DHT runs in a forked child, which owns the ``p2pd`` daemon. hivemind leaves
both running forever if the main process is SIGKILLed; :class:`WatchedDHT` makes the child shut
itself down (and ``p2pd`` with it) within seconds when its parent disappears.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import hivemind
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

# hivemind's SchemaValidator speaks pydantic v1; the DHT record models use its compatibility module.
from pydantic.v1 import BaseModel, StrictFloat, StrictInt, StrictStr

from p2ptrain import telemetry
from p2ptrain.config import SwarmConfig
from p2ptrain.logs import get_logger

log = get_logger(__name__)

PeerState = Literal["loading", "training", "averaging", "done", "left"]


class SwarmError(RuntimeError):
    """The swarm cannot be joined or used (unreachable peers, daemon failure). The message is for users."""


def parse_multiaddr(value: str) -> Multiaddr:
    """Parse a multiaddr, raising ``ValueError`` with a one-line reason on bad input."""
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...): {value!r}")
    try:
        return Multiaddr(value)
    except Exception as e:  # the vendored parser raises a zoo of types (ValueError, KeyError, binascii.Error)
        raise ValueError(f"not a valid multiaddr: {value!r} ({e})") from None


def is_loopback(maddr: str) -> bool:
    return maddr.startswith(("/ip4/127.", "/ip6/::1/", "/dns/localhost/", "/dns4/localhost/"))


class ProgressRecord(BaseModel):
    """What a peer tells the swarm about itself. Stored signed; read by every peer and by monitors."""

    peer_id: StrictStr
    """libp2p peer id (base58), used to download state from this peer."""
    round: StrictInt
    """The outer round this peer is in (its params are the global params of this round)."""
    state: StrictStr
    """loading | training | averaging | done | left (shut down: ignore it, even before its record expires)."""
    params_hash: StrictStr
    """Short hash of this peer's global params of ``round``: peers of one round must agree on it."""
    samples_round: StrictInt
    """Samples processed in this round's inner phase so far."""
    samples_total: StrictInt
    """Samples processed since this peer started."""
    samples_per_s: StrictFloat
    """Recent inner-phase throughput."""
    last_group_size: StrictInt
    """Size of the all-reduce group of this peer's last outer step (1: it averaged alone)."""
    device: StrictStr
    """cpu, cuda or mps."""
    time: StrictFloat
    """Wall-clock time of the record (seconds since the epoch)."""
    seen: StrictInt = 0
    """How many live peers (itself included) this peer sees."""
    view: StrictStr = ""
    """Short hash of the sorted ids of the live peers this peer sees (see :class:`SplitWatch`)."""


class _ProgressSchema(BaseModel):
    progress: dict[BytesWithPublicKey, ProgressRecord]


class _ParentWatchdog:
    """Mixin for hivemind's forked children: shut down cleanly when the parent process dies.

    ``_on_orphaned`` runs in a thread of the child; if the clean shutdown has not ended the process
    within ``grace_s``, the child exits hard.
    """

    _watched_parent_pid: int

    def _start_parent_watchdog(
        self, on_orphaned: Callable[[], None], grace_s: float = 10.0, own_process_group: bool = False
    ) -> None:
        """Call first thing in the child's ``run()``.

        Args:
            on_orphaned: starts the child's own clean shutdown; runs in a thread of the child.
            grace_s: after this long, exit hard.
            own_process_group: move the child (and what it spawns, like p2pd) out of the terminal's
                foreground process group, so that Ctrl-C reaches only the main process, which then shuts
                the children down in order. Otherwise p2pd dies first and the clean shutdown fails.
        """
        # The main process's signal handlers were inherited by fork; they are not the child's to run.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if own_process_group:
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)
        parent = self._watched_parent_pid

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            try:
                on_orphaned()
            finally:
                time.sleep(grace_s)
                os._exit(1)

        threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class WatchedDHT(_ParentWatchdog, hivemind.DHT):
    """A hivemind DHT whose child process (and its p2pd) does not outlive the main process."""

    def __init__(self, *args, **kwargs):
        self._watched_parent_pid = os.getpid()
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        # Sending the shutdown request through the same pipe the parent would use runs hivemind's own
        # clean shutdown, which terminates p2pd.
        self._start_parent_watchdog(
            lambda: self._outer_pipe.send(("_shutdown", [], {})), own_process_group=True
        )
        super().run()


def create_dht(cfg: SwarmConfig, record_validators: Sequence = ()) -> WatchedDHT:
    """Start a DHT (and its p2pd) and join the swarm, or raise :class:`SwarmError` within
    ``cfg.bootstrap_timeout_s``."""
    initial_peers = [*cfg.initial_peers, *read_maddrs_file(cfg.initial_peers_file, cfg.bootstrap_timeout_s)]
    # On loopback there is nothing to map or probe; UPnP discovery would multicast to the LAN.
    loopback_only = all(is_loopback(m) for m in cfg.host_maddrs)
    kwargs: dict[str, Any] = dict(
        nat_port_map=cfg.nat_port_map and not loopback_only,
        auto_nat=not loopback_only,
        initial_peers=list(initial_peers),
        host_maddrs=list(cfg.host_maddrs),
        announce_maddrs=list(cfg.announce_maddrs) or None,
        client_mode=cfg.client_mode,
        use_relay=cfg.use_relay,
        use_auto_relay=cfg.use_auto_relay,
        record_validators=list(record_validators),
        # p2pd exits by itself once its client (the DHT child) has been gone this long.
        idle_timeout=30,
        start=False,
    )
    if cfg.identity_path is not None:
        kwargs["identity_path"] = str(cfg.identity_path)
    dht = WatchedDHT(**kwargs)
    dht.start()
    try:
        dht.wait_until_ready(timeout=cfg.bootstrap_timeout_s)
    except TimeoutError:
        _stop_dht(dht)
        raise SwarmError(
            f"no initial peer answered within {cfg.bootstrap_timeout_s:.0f}s: {', '.join(initial_peers)}"
        ) from None
    except Exception as e:
        _stop_dht(dht)
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if initial_peers:
            raise SwarmError(
                f"could not join the swarm through {', '.join(initial_peers)}: {reason}"
            ) from None
        raise SwarmError(f"could not start the DHT: {reason}") from None
    return dht


def read_maddrs_file(path: Path | None, timeout_s: float) -> list[str]:
    """Multiaddrs from a file written by ``p2ptrain dht --maddrs-file``, waiting for it to appear."""
    if path is None:
        return []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            lines = [line.strip() for line in Path(path).read_text().splitlines()]
        except FileNotFoundError:
            lines = []
        maddrs = [line for line in lines if line and not line.startswith("#")]
        if maddrs:
            for maddr in maddrs:
                try:
                    parse_multiaddr(maddr)
                except ValueError as e:
                    raise SwarmError(f"{path}: {e}") from None
            return maddrs
        if time.monotonic() > deadline:
            raise SwarmError(
                f"swarm.initial_peers_file {path}: no multiaddr appeared within {timeout_s:.0f}s"
            )
        time.sleep(0.5)


def write_maddrs_file(path: Path, maddrs: Sequence[str]) -> None:
    """Atomically, so that a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{m}\n" for m in maddrs))
    os.replace(tmp, path)


def _stop_dht(dht: hivemind.DHT) -> None:
    if dht.is_alive():
        dht.shutdown()
    if dht.is_alive():
        dht.terminate()


@dataclass
class LocalStatus:
    """The mutable part of this peer's record; the trainer updates it, the heartbeat publishes it."""

    round: int = 0
    state: PeerState = "loading"
    params_hash: str = ""
    samples_round: int = 0
    samples_total: int = 0
    samples_per_s: float = 0.0
    last_group_size: int = 0
    seen: int = 0
    view: str = ""


class Swarm:
    """This peer's view of the swarm: its DHT, its published record and the others' records.

    The DHT's client pipe is not safe for concurrent use from several threads of one process, so every
    DHT call here holds ``self._lock``.
    """

    def __init__(self, run_id: str, cfg: SwarmConfig, *, device: str):
        self.run_id = run_id
        self.device = device
        self.heartbeat_s, self.record_ttl_s = cfg.heartbeat_s, cfg.record_ttl_s
        validators = progress_validators(run_id)
        self._public_key = validators[-1].local_public_key
        self.dht = create_dht(cfg, record_validators=validators)
        self.peer_id = self.dht.peer_id.to_base58()
        self.status = LocalStatus()
        self.split_watch = SplitWatch(cfg.split_warning_s)
        self._watch_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def progress_key(self) -> str:
        return progress_key(self.run_id)

    def visible_maddrs(self) -> list[str]:
        with self._lock:
            return [str(a) for a in self.dht.get_visible_maddrs()]

    def start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="swarm-heartbeat", daemon=True)
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
                self.peers()  # keeps our view fresh (and the split watch running) between the trainer's reads
            except Exception as e:  # a failed store is retried next beat; the record just ages meanwhile
                log.warning("progress record not stored", error=repr(e))
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()

    def update(self, **changes) -> None:
        """Change this peer's record; state changes are published at once, the rest with the next beat."""
        state_changed = "state" in changes and changes["state"] != self.status.state
        for key, value in changes.items():
            setattr(self.status, key, value)
        if state_changed or "round" in changes or "params_hash" in changes:
            if self._heartbeat is not None:
                self._wake.set()
            else:
                self.publish()

    def publish(self) -> None:
        s = self.status
        record = ProgressRecord(
            peer_id=self.peer_id,
            round=s.round,
            state=s.state,
            params_hash=s.params_hash,
            samples_round=s.samples_round,
            samples_total=s.samples_total,
            samples_per_s=float(s.samples_per_s),
            last_group_size=s.last_group_size,
            device=self.device,
            time=time.time(),
            seen=s.seen,
            view=s.view,
        )
        with self._lock:
            self.dht.store(
                self.progress_key,
                subkey=self._public_key,
                value=record.dict(),
                expiration_time=get_dht_time() + self.record_ttl_s,
            )

    def peers(self) -> dict[str, ProgressRecord]:
        """Live peers' records by peer id (this peer's own included once published; peers that left excluded)."""
        with self._lock:
            live = live_records(self.dht, self.run_id)
        telemetry.observe_swarm(live)
        self.status.seen = len(live.keys() | {self.peer_id})
        self.status.view = view_hash(live.keys() | {self.peer_id})
        with self._watch_lock:  # read by the heartbeat thread and the trainer
            warning = self.split_watch.observe(time.monotonic(), self.peer_id, self.status.round, live)
        if warning is not None:
            log.warning(
                "the swarm may be split: peers see different swarms. Check that every peer uses the same "
                "--initial-peers and that they can reach each other (firewall, NAT: see docs/deploy.md)",
                **warning,
            )
        return live

    def shutdown(self) -> None:
        """Say goodbye (a 'left' record, so nobody waits for us or asks us for state), then stop the DHT."""
        self._stop.set()
        self._wake.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if self.dht.is_alive():
            self.status.state = "left"
            try:
                self.publish()
            except Exception as e:  # best effort: the record expires after record_ttl_s anyway
                log.debug("goodbye record not stored", error=repr(e))
        with self._lock:
            _stop_dht(self.dht)


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def progress_validators(run_id: str) -> list:
    """The DHT record validators of a run: schema-checked, and signed by the peer that owns the subkey.

    Every node that stores records of the run should use them (peers, the bootstrap node, status readers),
    so that malformed or forged records are refused. The signer (last) holds a fresh key of this process.
    """
    return [SchemaValidator(_ProgressSchema, prefix=run_id), RSASignatureValidator(RSAPrivateKey())]


def live_records(dht: hivemind.DHT, run_id: str) -> dict[str, ProgressRecord]:
    """The unexpired records of ``run_id`` by peer id, without peers that said they left."""
    found = dht.get(progress_key(run_id), latest=True)
    return {pid: r for pid, r in records_from_dht_value(found).items() if r.state != "left"}


def records_from_dht_value(found) -> dict[str, ProgressRecord]:
    """Parse the value of ``{run_id}_progress`` (a dict of subkey -> value) into records by peer id."""
    records: dict[str, ProgressRecord] = {}
    if found is None or not isinstance(found.value, dict):
        return records
    for item in found.value.values():
        try:
            record = ProgressRecord.parse_obj(item.value)
        except Exception:  # the schema validator already rejects bad records; skip any leftovers
            continue
        previous = records.get(record.peer_id)
        if previous is None or record.time > previous.time:
            records[record.peer_id] = record
    return records


def view_hash(peer_ids) -> str:
    """A short hash of a set of peer ids: equal on peers that see the same live peers."""
    return hashlib.sha256("\n".join(sorted(peer_ids)).encode()).hexdigest()[:12]


class SplitWatch:
    """Notices when this peer and others keep seeing the swarm differently.

    A peer disagrees with us when its view (the set of live peers it sees) differs from ours, or its round
    is two or more from ours (peers of one swarm are at most one round apart, except while one catches up).
    Short disagreements are normal (a peer joins or leaves and records take a few heartbeats to spread);
    :meth:`observe` reports only those that last ``after_s``, at most once per ``after_s``.
    """

    def __init__(self, after_s: float):
        self.after_s = after_s
        self._since: dict[str, float] = {}  # peer id -> when we first saw it disagree (continuously since)
        self._last_warning = -float("inf")

    def observe(
        self, now: float, me: str, my_round: int, records: dict[str, ProgressRecord]
    ) -> dict[str, Any] | None:
        """Feed one reading of the live records; returns the warning's fields when one is due."""
        mine = view_hash(records.keys() | {me})
        disagreeing = {}
        for pid, r in records.items():
            if pid == me or r.state == "loading":
                continue
            other_view = bool(r.view) and r.view != mine
            far_round = abs(r.round - my_round) >= 2 and r.state != "done"
            if other_view or far_round:
                disagreeing[pid] = r
        self._since = {pid: self._since.get(pid, now) for pid in disagreeing}
        lasting = [pid for pid, t in self._since.items() if now - t >= self.after_s]
        if not lasting or now - self._last_warning < self.after_s:
            return None
        self._last_warning = now
        return {
            "for_s": round(max(now - self._since[pid] for pid in lasting), 1),
            "we_see": len(records.keys() | {me}),
            "our_round": my_round,
            "they_see": {pid[-8:]: disagreeing[pid].seen for pid in lasting},
            "their_rounds": {pid[-8:]: disagreeing[pid].round for pid in lasting},
        }


def global_round(records: dict[str, ProgressRecord]) -> int:
    """The swarm's round: the highest round any live peer holds params of (loading peers excluded)."""
    rounds = [r.round for r in records.values() if r.state != "loading" and r.params_hash]
    return max(rounds, default=-1)


def canonical_hash(records: Sequence[ProgressRecord]) -> str | None:
    """The params hash that peers of one round should converge on, or None if nobody reported one.

    The most common hash wins; ties go to the hash whose holders averaged in the larger group last
    round, then to the smaller hash string, so that every peer that sees the same records picks the
    same winner.
    """
    counts = Counter(r.params_hash for r in records if r.params_hash)
    if not counts:
        return None
    best_group = {h: max(r.last_group_size for r in records if r.params_hash == h) for h in counts}
    return min(counts, key=lambda h: (-counts[h], -best_group[h], h))
