"""The swarm's records board on a hivemind DHT: this peer's signed progress record, and everyone's.

There is no coordinator. Each peer publishes a small record (``records.ProgressRecord``): signed with the
peer's RSA key under ``{run_id}_progress`` in the DHT, one subkey per peer, and pushed straight to every
peer it knows (``board.py``), at once when its state, round or params change and every
``swarm.heartbeat_s`` from a background thread. A record older than ``swarm.record_ttl_s`` expires: that
peer is gone. Reading the records asks the table the DHT child keeps of them, not the network. What a
peer decides from the records is in ``protocol.py``; this module only moves them.

The subkey is the signer's public key, which is also the peer's libp2p identity: only its owner can
write it, and a reader keeps a record only if its ``peer_id`` is its signer's. No node stores a record
that expires later than :data:`MAX_RECORD_TTL_S` from now, so a peer that stops refreshing its record is
gone within that time whatever it asked for.

Each record also carries the peer's *view*: a short hash of the set of live peers it sees. Peers of a
healthy swarm see the same set within a few heartbeats. :class:`~p2ptrain.records.SplitWatch` warns
when they have not for ``swarm.split_warning_s``.

Process model: the DHT runs in a forked child, which owns the ``p2pd`` daemon; :class:`WatchedDHT`
makes the child shut itself down (and ``p2pd`` with it) when the main process disappears.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MPFuture
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

# hivemind's SchemaValidator speaks pydantic v1; the DHT record models use its compatibility module.
from pydantic.v1 import BaseModel

from p2ptrain.addrs import SwarmError, is_loopback, read_maddrs_file
from p2ptrain.board import REPLICAS, BoardService, records_from_dht_value, share_period_s
from p2ptrain.config import ExperimentConfig, SwarmConfig
from p2ptrain.dhtstorage import install as install_bounds
from p2ptrain.experiment import EXPERIMENTS_KEY, Experiment, ExperimentRecord, published, sign
from p2ptrain.experiment import subkey as experiment_subkey
from p2ptrain.logs import get_logger
from p2ptrain.membership import (
    SwarmKeyAuthorizer,
    create_identity,
    load_identity,
    peer_id_of,
    read_swarm_key,
)
from p2ptrain.procs import ParentWatchdog, SerialSends, WholeMessages
from p2ptrain.records import PeerState, ProgressRecord, SplitWatch, live, view_hash

log = get_logger(__name__)

RecordsObserver = Callable[[dict[str, ProgressRecord]], None]


class _ProgressSchema(BaseModel):
    progress: dict[BytesWithPublicKey, ProgressRecord]  # type: ignore[valid-type]


class _ExperimentsSchema(BaseModel):
    experiments: dict[BytesWithPublicKey, ExperimentRecord]  # type: ignore[valid-type]


class WatchedDHT(ParentWatchdog, hivemind.DHT):
    """A hivemind DHT whose child process (and its p2pd) does not outlive the main process, and which keeps
    the run's records board in that child (:meth:`board`)."""

    def __init__(self, *args, kept_keys: Collection[DHTID] = (), **kwargs):
        self._watched_parent_pid = os.getpid()
        self._board: BoardService | None = None  # made in the child, by board("open", ...)
        self._kept_keys = frozenset(kept_keys)
        self.joined_through: list[str] = []
        super().__init__(*args, **kwargs)
        self._outer_pipe = SerialSends(self._outer_pipe)  # type: ignore[has-type]  # hivemind's, untyped

    def board(self, op: str, *, return_future: bool = False, **kwargs: Any) -> Any:
        """Call :class:`~p2ptrain.board.BoardService`'s ``op`` in the DHT child (``open`` makes it), from the
        main process or the averager's; as hivemind's own calls, through the DHT's pipe."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_board_op", [op, kwargs], dict(future=future)))
        return future if return_future else future.result(timeout=BOARD_TIMEOUT_S)

    async def _board_op(self, op: str, kwargs: dict, future: MPFuture) -> None:
        try:
            if op == "open":
                self._board = BoardService(self._node, **kwargs)
                await self._board.open()
                future.set_result(None)
                return
            if self._board is None:
                raise RuntimeError("the records board is not open")
            result = getattr(self._board, op)
            result = result(**kwargs) if callable(result) else result  # an attribute: its value
            future.set_result(await result if asyncio.iscoroutine(result) else result)
        except BaseException as e:  # hivemind's convention: the caller gets the exception
            future.set_exception(e)

    def run(self) -> None:
        # Sending the shutdown request through the same pipe the parent would use runs hivemind's own
        # clean shutdown, which terminates p2pd.
        self._start_parent_watchdog(
            lambda: self._outer_pipe.send(("_shutdown", [], {})), own_process_group=True
        )
        self._inner_pipe = WholeMessages(self._inner_pipe)  # type: ignore[has-type]  # hivemind's, untyped
        # In this child only: the node's storage, its cache and its reads keep every answer to a read within
        # one message, and all it holds bounded (dhtstorage.py).
        install_bounds(self._kept_keys)
        super().run()


def create_dht(
    cfg: SwarmConfig,
    record_validators: Sequence = (),
    *,
    identity_file: Path | None = None,
    fresh_identity: bool = False,
) -> WatchedDHT:
    """Start a DHT (and its p2pd) and join the swarm, or raise :class:`SwarmError` within
    ``cfg.bootstrap_timeout_s``.

    With ``cfg.key_file``, the DHT talks only to holders of that swarm key (``membership.py``). The
    identity is ``identity_file`` (default ``cfg.identity_path``; ``fresh_identity``: we just made it, so
    nobody else can be using it).
    """
    authorizer = SwarmKeyAuthorizer(read_swarm_key(cfg.key_file)) if cfg.key_file is not None else None
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
        authorizer=authorizer,
        **DHT_TUNING,
        # p2pd exits by itself once its client (the DHT child) has been gone this long.
        idle_timeout=30,
        start=False,
    )
    identity_file = identity_file if identity_file is not None else cfg.identity_path
    if identity_file is not None:
        if not fresh_identity and Path(identity_file).exists():
            # Loaded here for its error, which names the file (p2pd's does not).
            _identity(Path(identity_file), Path(identity_file).parent)
        kwargs["identity_path"] = str(identity_file)
        kwargs["check_if_identity_free"] = not fresh_identity
    # The run's keys, whose expiry the validators cap, are bounded per key only: no other key crowds them out.
    kept = [key for v in record_validators if isinstance(v, _ExpiryCap) for key in v.key_ids]
    dht = WatchedDHT(kept_keys=kept, **kwargs)
    dht.joined_through = list(initial_peers)  # the board pings them again after an outage (board.rejoin)
    dht.start()
    # A node of a closed swarm drops whoever lacks its key as if nobody were there: either may be the cause.
    keys = (
        "do they hold this swarm's swarm.key_file?"
        if authorizer is not None
        else "or the swarm is closed and this peer lacks its key: --key-file"
    )
    hint = (
        f" (nobody answers there: the swarm may have ended, or the address is wrong or unreachable; {keys})"
    )
    try:
        dht.wait_until_ready(timeout=cfg.bootstrap_timeout_s)
    except TimeoutError:
        stop_dht(dht)
        raise SwarmError(
            f"no initial peer answered within {cfg.bootstrap_timeout_s:.0f}s: {', '.join(initial_peers)}{hint}"
        ) from None
    except BaseException as e:  # a Ctrl-C or a second signal too: the DHT child and p2pd go with us
        stop_dht(dht)
        if not isinstance(e, Exception):
            raise
        reason = _reason(e)
        if initial_peers:
            raise SwarmError(
                f"could not join the swarm through {', '.join(initial_peers)}: {reason}{hint}"
            ) from None
        raise SwarmError(f"could not start the DHT: {reason}") from None
    if authorizer is None:
        log.warning(
            "open swarm: no swarm.key_file, so anyone who can reach this peer can read and write the run's "
            "records, join its all-reduce and download its state (`p2ptrain keygen` makes a key)",
            peer_id=dht.peer_id.to_base58(),
        )
    return dht


def _reason(error: Exception) -> str:
    """hivemind's error as a user's line: its last line, without p2pd's timestamp or advice for hivemind's
    own callers (``ensure_bootstrap_success``, which no p2ptrain setting reaches)."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[-1]
    line = re.sub(r"\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2}(\.\d+)? ", "", line)
    return re.sub(r"\s*\(set ensure_bootstrap_success=False to ignore\)", "", line).strip()


def stop_dht(dht: hivemind.DHT) -> None:
    if dht.is_alive():
        dht.shutdown()
    if dht.is_alive():
        dht.terminate()


@dataclass
class LocalStatus:
    """The mutable part of this peer's record; the trainer updates it, the heartbeat publishes it: every field
    of :class:`~p2ptrain.records.ProgressRecord` but those the swarm fills in (:data:`SET_BY_SWARM`)."""

    round: int = 0
    state: PeerState = PeerState.LOADING
    params_hash: str = ""
    samples_round: int = 0
    samples_total: int = 0
    samples_per_s: float = 0.0
    last_group_size: int = 0
    seen: int = 0
    view: str = ""
    benchmark_samples_per_s: float = 0.0
    benchmark_flops: float = 0.0
    compute_s: float = 0.0
    rounds_contributed: int = 0
    group: list[str] = field(default_factory=list)
    # A verifiable round's claims (records.ProgressRecord documents them).
    numeric_class: str = ""
    shard: str = ""
    replicas: list[str] = field(default_factory=list)
    roster: list[str] = field(default_factory=list)
    roster_classes: list[str] = field(default_factory=list)
    seal: str = ""
    digest: str = ""
    nonce: str = ""
    parts: bytes = b""
    sketch: bytes = b""
    verdict: str = ""
    ref_round: int = -1
    ref_group: list[str] = field(default_factory=list)
    ref_sketch: bytes = b""
    trusted: list[str] = field(default_factory=list)
    struck: list[str] = field(default_factory=list)
    banned: list[str] = field(default_factory=list)
    reputation: str = ""


SET_BY_SWARM = frozenset({"peer_id", "device", "time", "serves"})
"""The record's fields that :meth:`Swarm.publish` sets, not the trainer."""


def check_fields(changes: Mapping[str, Any]) -> None:
    """Raise AttributeError naming a change to a field that the trainer cannot set in its record."""
    for key in changes:
        if key not in LocalStatus.__dataclass_fields__:
            raise AttributeError(f"a progress record has no field {key!r}")


def with_group_cleared(changes: dict[str, Any], *, state: PeerState, round: int) -> dict[str, Any]:
    """``changes`` to a record now at ``state`` and ``round``, clearing its ``group`` when they move it on: the
    group is the one its barrier found in the round it is averaging, not carried past it (a list of peer ids
    in every push of the next inner phase doubled what pushes cost at 6 peers)."""
    moved = changes.get("state", state) != state or changes.get("round", round) != round
    return {**changes, "group": []} if moved and "group" not in changes else changes


_AT_ONCE = {"state", "round", "params_hash", "group", "seal", "nonce", "sketch", "verdict", "ref_sketch"}
"""Changes published at once, not with the next beat, and pushed to every peer: replicas and the barrier wait
on them. The others (samples, throughput, counters) reach the DHT with the next beat and the peers with the
next push."""


class Swarm:
    """This peer's records board on the DHT: its published record and the others' records.

    The DHT's client pipe is not safe for concurrent use from several threads of one process, so every
    DHT call here holds ``self._lock``.

    """

    def __init__(self, run_id: str, cfg: SwarmConfig, *, device: str):
        self.run_id = run_id
        self.device = device
        self.heartbeat_s, self.record_ttl_s = cfg.heartbeat_s, cfg.record_ttl_s
        self.serves = not cfg.client_mode  # a client-mode peer's averager does not share its state
        with tempfile.TemporaryDirectory(prefix="p2ptrain-identity-") as tmp:
            identity_file, signer, fresh = _identity(cfg.identity_path, Path(tmp))
            validators = progress_validators(run_id, signer=signer)
            self._public_key = validators[-1].local_public_key
            self._signer = signer
            # p2pd reads the identity at start; a temporary one is gone once the DHT is up.
            self.dht = create_dht(
                cfg, record_validators=validators, identity_file=identity_file, fresh_identity=fresh
            )
        self.peer_id = self.dht.peer_id.to_base58()
        # Every reader would drop our records if the DHT's peer id were not our signer's.
        if peer_id_of(signer.get_public_key()) != self.peer_id:
            stop_dht(self.dht)
            raise SwarmError("the DHT's peer id is not the one of its identity file")
        self.status = LocalStatus()
        try:
            self.dht.board(
                "open",
                key=progress_key(run_id),
                subkey=self._public_key,
                ttl_s=self.record_ttl_s,
                heartbeat_s=self.heartbeat_s,
                initial_peers=self.dht.joined_through,
            )
        except BaseException as e:
            stop_dht(self.dht)
            if not isinstance(e, Exception):
                raise
            raise SwarmError(f"could not start the records board: {e}") from None
        self._version = -1
        self._records: dict[str, ProgressRecord] = {}
        self._urgent = True
        """A change the peers must hear of at once is not published yet (the first record is one)."""
        self.split_watch = SplitWatch(cfg.split_warning_s)
        self._subscribers: list[RecordsObserver] = []
        self._watch_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._experiment: ExperimentRecord | None = None
        self._experiment_stored = -float("inf")
        self._experiment_every = float(cfg.record_ttl_s)
        self._last_read = -float("inf")

    def subscribe(self, observer: RecordsObserver) -> None:
        """Call ``observer`` with every record (``left`` ones included) after every reading."""
        self._subscribers.append(observer)

    def visible_maddrs(self) -> list[str]:
        with self._lock:
            return [str(a) for a in self.dht.get_visible_maddrs()]

    def start(self) -> None:
        """Start the heartbeat: publish our record every ``swarm.heartbeat_s`` (and at once on changes)."""
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="swarm-heartbeat", daemon=True)
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
                every = min(
                    self._experiment_every, experiment_period_s(self.record_ttl_s, len(live(self._records)))
                )
                if time.monotonic() - self._experiment_stored > every:
                    self._store_experiment()
                # Keeps our view fresh (and the split watch running) between the trainer's reads.
                if time.monotonic() - self._last_read > self.heartbeat_s / 2:
                    self.records()
            except Exception as e:  # a failed store is retried next beat; the record just ages meanwhile
                log.warning("progress record not stored", error=repr(e))
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()

    def update(self, **changes: Any) -> None:
        """Change this peer's record; state, round and params changes are published at once, the rest with
        the next beat."""
        state_changed = "state" in changes and changes["state"] != self.status.state
        changes = with_group_cleared(changes, state=self.status.state, round=self.status.round)
        check_fields(changes)
        for key, value in changes.items():
            setattr(self.status, key, value)
        if state_changed or (changes.keys() & _AT_ONCE) - {"state"}:
            self._urgent = True
            if self._heartbeat is not None:
                self._wake.set()
            else:
                self.publish()

    def publish(self) -> None:
        """Publish our record: pushed to every peer we know if it changed what they wait on (or they have
        not heard from us for a while), stored in the DHT when that is due (``board.BoardService.publish``)."""
        fields = asdict(self.status)
        for name in ("samples_per_s", "benchmark_samples_per_s", "benchmark_flops", "compute_s"):
            fields[name] = float(fields[name])
        record = ProgressRecord(
            peer_id=self.peer_id, device=self.device, time=time.time(), serves=self.serves, **fields
        )
        leaving = record.state == PeerState.LEFT
        urgent, self._urgent = self._urgent or leaving, False
        with self._lock:
            future = self.dht.board(
                "publish", wire=record.wire(), urgent=urgent, wait=leaving, return_future=True
            )
        future.result(timeout=BOARD_TIMEOUT_S)

    def experiments(self) -> list[Experiment]:
        """Every experiment published in the swarm whose owner's signature holds (``experiment.published``)."""
        with self._lock:
            return published(read_latest(self.dht, EXPERIMENTS_KEY))

    def sign_experiment(self, cfg: ExperimentConfig) -> ExperimentRecord:
        """This config's training sections, signed with our identity: we start the run."""
        return sign(cfg, self._signer)

    def carry_experiment(self, record: ExperimentRecord) -> None:
        """Store the run's signed experiment under our subkey, now and every :func:`experiment_period_s`: it
        lives in the swarm as long as one of its peers does, and a joiner takes the one most peers carry."""
        self._experiment = record
        self._store_experiment()

    def _store_experiment(self) -> None:
        if self._experiment is None:
            return
        # Refreshed before it expires even if the swarm grows meanwhile (the next period is at most this one).
        every = self._experiment_every = experiment_period_s(self.record_ttl_s, len(live(self._records)))
        with self._lock:
            future = self.dht.board(
                "store",
                key=EXPERIMENTS_KEY,
                subkey=experiment_subkey(self._experiment.run_id, self._public_key),
                value=self._experiment.dict(),
                expiration=get_dht_time() + min(3 * every, MAX_RECORD_TTL_S),
                return_future=True,
            )
        future.result(timeout=BOARD_TIMEOUT_S)
        self._experiment_stored = time.monotonic()

    def wait_for_news(self, timeout_s: float) -> None:
        """Return as soon as the DHT child's board holds records other than those of our last reading (a push
        came), or after ``timeout_s``."""
        with self._lock:
            future = self.dht.board("news", since=self._version, timeout_s=timeout_s, return_future=True)
        future.result(timeout=BOARD_TIMEOUT_S + timeout_s)

    def records(self) -> dict[str, ProgressRecord]:
        """Every unexpired record by peer id, ``left`` ones and our own included: what the DHT child's board
        holds (no network; the records are sent over only when they changed since our last reading)."""
        with self._lock:
            future = self.dht.board("records", since=self._version, return_future=True)
        version, found = future.result(timeout=BOARD_TIMEOUT_S)
        if found is not None:
            self._version, self._records = version, found
        self._last_read = time.monotonic()
        records = dict(self._records)
        for subscriber in self._subscribers:
            subscriber(records)
        alive = live(records)
        self.status.seen = len(alive.keys() | {self.peer_id})
        self.status.view = view_hash(alive.keys() | {self.peer_id})
        with self._watch_lock:  # read by the heartbeat thread and the trainer
            warning = self.split_watch.observe(time.monotonic(), self.peer_id, self.status.round, alive)
        if warning is not None:
            log.warning(
                "the swarm may be split: peers see different swarms. Check that every peer uses the same "
                "--initial-peers and that they can reach each other (firewall, NAT: see docs/deploy.md)",
                **warning,
            )
        return records

    def shutdown(self, *, say_goodbye: bool = True) -> None:
        """Say goodbye (a 'left' record, so nobody waits for us or asks us for state), then stop the DHT."""
        self._stop.set()
        self._wake.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        if say_goodbye and self.dht.is_alive():
            self.status.state = PeerState.LEFT
            try:
                self.publish()
            except Exception as e:  # best effort: the record expires after record_ttl_s anyway
                log.debug("goodbye record not stored", error=repr(e))
        with contextlib.suppress(Exception):  # what the board cost, for whoever reads the log to the end
            log.info("records board", **dataclasses.asdict(self.dht.board("traffic")))
        with self._lock:
            stop_dht(self.dht)


def _identity(path: Path | None, tmp: Path) -> tuple[Path, RSAPrivateKey, bool]:
    """This peer's identity file, its key (which signs our records) and whether it is new. Without a
    configured path, a new identity in ``tmp``."""
    if path is not None and path.exists():
        try:
            return path, load_identity(path), False
        except SwarmError:
            raise
        except Exception as e:  # unreadable, or not a libp2p key file
            raise SwarmError(f"swarm.identity_path {path}: not a usable identity file ({e})") from None
    target = path if path is not None else tmp / "identity.key"
    try:
        return target, create_identity(target), True
    except OSError as e:
        raise SwarmError(f"swarm.identity_path {target}: cannot create it ({e.strerror or e})") from None


BOARD_TIMEOUT_S = 30.0
"""How long a call of the DHT child's board may take (it answers from memory: only a stuck child is slower)."""

READ_FANOUT = 2
"""How many of the nodes nearest to a key a reader of the DHT asks (besides its own storage): every peer
stores its record on the same :data:`~p2ptrain.board.REPLICAS` nodes nearest to the key, each of which holds
every record, so two answers are enough. hivemind's default asks up to 20 nodes, each answering with every
peer's record."""


DHT_TUNING: dict[str, Any] = dict(
    num_replicas=REPLICAS,
    # hivemind pushes every value it finds to one more node and re-reads cached keys before they expire: with
    # a key whose value holds every peer's record, both cost O(N) bytes a read and help nobody (we always read
    # the latest value).
    cache_nearest=0,
    cache_refresh_before_expiry=0,
)
"""Our DHT node's settings where hivemind's defaults do not fit a key with every peer's record in it."""


def experiment_period_s(ttl_s: float, live: int) -> float:
    """How often a peer of a swarm of ``live`` peers stores its copy of the run's signed experiment again;
    each copy lives three times as long. Every peer carries one (a joiner takes the experiment that most
    peers carry, so that a few hostile peers cannot pass off another), but each copy is a store on
    :data:`~p2ptrain.board.REPLICAS` nodes: the copies of N peers are refreshed as often, all together, as
    those of REPLICAS peers every ``ttl_s``, up to a third of the longest a node keeps a record."""
    return min(share_period_s(ttl_s, live), MAX_RECORD_TTL_S / 3)


def read_latest(dht: hivemind.DHT, key: str) -> Any:
    """The latest value of a dictionary key (every subkey's newest item), merged from our own storage and the
    :data:`READ_FANOUT` nearest nodes that hold it."""
    return dht.get(key, latest=True, beam_size=READ_FANOUT)


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


MAX_RECORD_TTL_S = 600.0
"""No node stores a progress record that asks to be kept longer than this from now. A constant, not a
config value: hivemind drops a whole key's value when one of its records fails a node's validators, so
every node of a swarm must apply the same cap (``swarm.record_ttl_s`` is at most half of it)."""


class _ExpiryCap(RecordValidatorBase):
    """Refuses a progress record (or a published experiment) that asks to be kept longer than
    :data:`MAX_RECORD_TTL_S` from now: a peer that stops refreshing its record must be gone soon, whatever it
    asked for."""

    def __init__(self, run_id: str | None, max_ttl_s: float = MAX_RECORD_TTL_S):
        keys = [EXPERIMENTS_KEY] + ([progress_key(run_id)] if run_id is not None else [])
        self.key_ids = frozenset(DHTID.generate(source=key) for key in keys)
        """The run's keys: the progress records (with a run id) and the published experiments."""
        self._keys = {key_id.to_bytes() for key_id in self.key_ids}
        self.max_ttl_s = max_ttl_s

    def validate(self, record: DHTRecord) -> bool:
        return record.key not in self._keys or record.expiration_time <= get_dht_time() + self.max_ttl_s


def progress_validators(run_id: str | None, *, signer: RSAPrivateKey | None = None) -> list:
    """The DHT record validators of a run: schema-checked, and signed by the peer that owns the subkey.

    Every node that stores records of the run should use them (peers, the bootstrap node, status readers),
    so that malformed or forged records are refused; they cover the published experiments of every run
    too (``experiment.py``). The signer (last) signs our own records: a peer's identity key, so that
    readers can check a record's peer id against it; a reader that publishes nothing passes none.
    ``run_id`` None: a reader of the published experiments only.
    """
    schemas = [SchemaValidator(_ExperimentsSchema, prefix="p2ptrain")]  # the key p2ptrain_experiments
    if run_id is not None:
        schemas.insert(0, SchemaValidator(_ProgressSchema, prefix=run_id))
    return [
        *schemas,
        _ExpiryCap(run_id),
        RSASignatureValidator(signer if signer is not None else RSAPrivateKey()),
    ]


def published_experiments(dht: hivemind.DHT) -> list[Experiment]:
    """Every experiment published in the swarm whose owner's signature holds."""
    return published(read_latest(dht, EXPERIMENTS_KEY))


def live_records(dht: hivemind.DHT, run_id: str) -> dict[str, ProgressRecord]:
    """The unexpired records of ``run_id`` by peer id, without peers that said they left."""
    return live(records_from_dht_value(read_latest(dht, progress_key(run_id))))
