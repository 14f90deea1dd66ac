"""What this peer knows of the run's progress records, kept in its DHT child and read without the network.

Reading the records from the DHT fetched every peer's signed record (about 1.3 kB each) from several nodes
on every read, and a peer read them every few hundred milliseconds at its barrier: O(N) bytes a read, O(N²)
for the swarm. Here records travel the other way, and only when they change:

- **Pushes.** Whenever a peer's state, round or params change (what the others' barriers and catch-ups wait
  on), and at least every ``record_ttl_s / 3`` (so that it stays alive in their tables), its DHT child sends
  its record, unsigned and without the fields left at their defaults (about 0.3 kB), straight to every peer
  it knows, over the libp2p connections the DHT already holds. Samples and counters ride along.
- **The DHT** keeps every peer's signed record for whoever reads it there (a newcomer, ``p2ptrain status``,
  a bootstrap node's metrics): each peer stores its own every ``record_ttl_s / 3`` on the nodes nearest to
  the key (:data:`REPLICAS`), straight to them as its routing table knows them, with a full search every
  :data:`SEARCH_EVERY` stores so that it follows the key's nearest nodes as the swarm changes.
- **Reads of the DHT** happen when a peer starts, every ``record_ttl_s * N / REPLICAS`` for a peer that knows
  N peers (:func:`share_period_s`: the swarm as a whole reads about every ``record_ttl_s / REPLICAS``, and
  each peer's share stays the same as it grows; one node; every heartbeat while it knows no other peer),
  and soon after an unknown peer pushes or a peer sees the swarm otherwise than we do
  (at most once a heartbeat): that finds newcomers and heals a lost push or a split. Newly found peers get
  our record at once.
  A newcomer's first push is answered with the receiver's record, so it learns the swarm's state at once.

Readers (the trainer, its heartbeat, the averager child) ask the table in the DHT child: a pipe round trip.

Trust. A push speaks for its sender only: its peer id is the connection's, which libp2p authenticates,
and it is checked as a record in the DHT is (every field bounded). It is taken only from a *member*, a peer
whose signed record this node has read from the DHT, where only holders of the swarm key can store one: no
key, no push. A record older than the one held (a replay, a reorder) is dropped; any record, pushed or read,
keeps its peer alive for its time to live.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from p2ptrain.logs import get_logger
from p2ptrain.membership import peer_id_of_owner
from p2ptrain.records import PeerState, ProgressRecord, view_hash

log = get_logger(__name__)

PUSH_PROTOCOL = "p2ptrain.Board.push"
"""The libp2p protocol a record is pushed with (hivemind names its handlers ``<class>.<method>`` too)."""

REPLICAS = 3
"""How many nodes nearest to the progress key store each peer's signed record (hivemind's ``num_replicas``,
whose default is 5)."""

SEARCH_EVERY = 10
"""One store in this many searches the DHT for the key's nearest nodes (the others go straight to the
nearest our routing table knows: a search asks each node near the key, and each answers with every record)."""

MAX_PUSH_BYTES = 64 * 1024
"""The largest push taken: a verifiable round's record with its sketches and part digests is under 25 kB."""

PUSH_TIMEOUT_S = 5.0
"""How long a push to one peer may take; a peer that does not answer gets the next one all the same."""

REJOIN_S = 5.0
"""While this node's DHT routing table is empty, it knows no other live peer, or another peer knows peers it
does not, it tries to reach the peers it lost, at most this often (:meth:`BoardService.rejoin`)."""

FORGET_S = 600.0
"""A peer not heard from for this long is not looked for by :meth:`BoardService.rejoin` any more (p2pd has
forgotten its addresses by then too)."""


def share_period_s(period_s: float, live: int) -> float:
    """How often each of ``live`` peers does what the swarm needs done about :data:`REPLICAS` times per
    ``period_s``: every ``period_s * live / REPLICAS`` (every ``period_s`` in a swarm of up to REPLICAS
    peers). What it costs one peer per round then stays the same as the swarm grows.

    The unasked reads of every record from the DHT go at this pace (of ``ttl_s``). Such a read is a safety
    net: it finds peers that no push told us of (two halves of a swarm that started apart, a lost push), and
    its answer holds every peer's signed record, O(N) bytes. It is enough that *someone* reads about every
    ``ttl_s / REPLICAS``: whoever finds a stranger pushes our record to it, which reads the DHT in turn and
    pushes on."""
    return period_s * max(1.0, live / REPLICAS)


def compact(wire: dict[str, Any]) -> dict[str, Any]:
    """A record's wire form without the fields at their defaults (the schema puts them back)."""
    fields = ProgressRecord.__fields__
    return {k: v for k, v in wire.items() if fields[k].required or v != fields[k].default}


def records_from_dht_value(found: Any) -> dict[str, ProgressRecord]:
    """Parse the value of ``{run_id}_progress`` (a dict of subkey -> value) into records by peer id."""
    return {pid: record for pid, (record, _) in _signed_records(found).items()}


def _signed_records(found: Any) -> dict[str, tuple[ProgressRecord, float]]:
    """(record, expiration time) by peer id, from a DHT value of the progress key."""
    records: dict[str, tuple[ProgressRecord, float]] = {}
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return records
    for subkey, item in found.value.items():
        try:
            record = ProgressRecord.parse_obj(item.value)
        except Exception:  # the schema validator already rejects bad records; skip any leftovers
            continue
        # A record speaks for its signer only: one per identity, and nobody can publish in another's name.
        if record.peer_id == peer_id_of_owner(subkey):
            records[record.peer_id] = (record, item.expiration_time)
    return records


@dataclass
class _Entry:
    record: ProgressRecord
    expires: float
    """DHT time after which the peer is gone unless a newer push or read says otherwise."""


@dataclass
class Traffic:
    """What this node's board has sent and taken (for tests and the benchmarks)."""

    pushes_sent: int = 0
    pushes_failed: int = 0
    pushes_taken: int = 0
    pushes_refused: int = 0
    dht_reads: int = 0
    dht_stores: int = 0
    dht_searches: int = 0


class BoardService:
    """The records table of one peer, in its DHT child (``swarm.WatchedDHT`` makes it and calls its methods).

    Args:
        node: the DHT child's node.
        key: the run's progress key.
        subkey: our signed-record subkey (``[owner:<our public key>]``).
        ttl_s: how long our records live without news from us (``swarm.record_ttl_s``).
        heartbeat_s: ``swarm.heartbeat_s``: reads of the DHT that pushes ask for come at most this often.
    """

    def __init__(
        self,
        node: DHTNode,
        *,
        key: str,
        subkey: bytes,
        ttl_s: float,
        heartbeat_s: float,
        initial_peers: Sequence[str] = (),
    ):
        self.node = node
        self.initial_peers = [Multiaddr(m) for m in initial_peers]
        self.key, self.key_id, self.subkey = key, DHTID.generate(source=key), subkey
        self.ttl_s, self.heartbeat_s = ttl_s, heartbeat_s
        self.me = node.peer_id.to_base58()
        self.entries: dict[str, _Entry] = {}
        self.members: set[str] = set()
        """Peers whose signed record this node has read from the DHT: only they may push."""
        self.version = 0
        self._news: asyncio.Event | None = None
        self.traffic = Traffic()
        self._own: ProgressRecord | None = None
        self._stored_at = -float("inf")
        self._pushed_at = -float("inf")
        self._stores: dict[str, int] = {}
        self._read_at = -float("inf")
        self._reading: asyncio.Task | None = None
        self._pushes: set[asyncio.Task] = set()
        self._discovery: asyncio.Task | None = None
        self._rejoined_at = -float("inf")
        self._rejoining: asyncio.Task | None = None
        self._heard_at: dict[str, float] = {}  # peer -> when we last took a record of it (monotonic)

    async def open(self) -> None:
        await self.node.p2p._client.add_unary_handler(PUSH_PROTOCOL, self._on_push)
        await self.read_dht()
        self._discovery = asyncio.create_task(self._discover_periodically())

    async def close(self) -> None:
        for task in (self._discovery, self._rejoining):
            if task is not None:
                task.cancel()
        for task in list(self._pushes):
            task.cancel()

    # ------------------------------------------------------------------------------ reading

    def records(self, since: int = -1) -> tuple[int, dict[str, ProgressRecord] | None]:
        """(version, every unexpired record by peer id, ours and ``left`` ones included), or (version, None)
        if nothing changed since version ``since``."""
        now = get_dht_time()
        expired = [pid for pid, e in self.entries.items() if e.expires < now and pid != self.me]
        for pid in expired:
            del self.entries[pid]
        if expired:
            self._changed()
        if since == self.version:
            return self.version, None
        return self.version, {pid: e.record for pid, e in self.entries.items()}

    async def news(self, since: int, timeout_s: float) -> int:
        """Wait until the records differ from version ``since`` (at once if they do) or ``timeout_s`` passed;
        the version now. A barrier waits with it: it hears of a groupmate's push as it lands, not at its next
        poll."""
        if self.version == since:
            if self._news is None:
                self._news = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._news.wait(), timeout_s)
        return self.version

    def _changed(self) -> None:
        self.version += 1
        if self._news is not None:  # wake whoever waits for news
            self._news.set()
            self._news = None

    async def live_members(self, peer: str | None = None) -> set[str]:
        """The live peers (us included); when ``peer`` is not among them (a caller of our averager that we have
        not heard from yet), after a read of the DHT."""
        if peer is not None and peer not in self._live():
            await self.read_dht()
        return set(self._live())

    def _take(self, record: ProgressRecord, expires: float) -> bool:
        """Keep ``record`` if it is not older than the one we hold; any record extends its peer's life."""
        entry = self.entries.get(record.peer_id)
        if record.state == PeerState.LEFT:  # nobody to look for after an outage
            self._heard_at.pop(record.peer_id, None)
        else:
            self._heard_at[record.peer_id] = time.monotonic()
        if entry is None or record.time >= entry.record.time:
            changed = entry is None or record != entry.record
            self.entries[record.peer_id] = _Entry(record, max(expires, entry.expires if entry else 0.0))
            if changed:
                self._changed()
            return True
        entry.expires = max(entry.expires, expires)
        return False

    async def read_dht(self, beam_size: int = 2) -> None:
        """Read every signed record from the DHT (our storage and ``beam_size`` of the nearest nodes)."""
        self._read_at = time.monotonic()
        self.traffic.dht_reads += 1
        try:
            found = await self.node.get(self.key, latest=True, beam_size=beam_size)
        except Exception as e:  # the DHT is busy: pushes still arrive, and the next read comes
            log.debug("could not read the run's records", error=repr(e))
            return
        known = set(self._live())
        for pid, (record, expires) in _signed_records(found).items():
            self.members.add(pid)
            if pid != self.me:
                self._take(record, expires)
        # Peers we had not heard from may not have heard from us either (we started together, say): our
        # record goes to them now, not with our next change.
        if self._own is not None and (new := [p for p in self._push_targets() if p not in known]):
            self._push_all(new, self._own.wire())

    def _read_soon(self) -> asyncio.Task:
        """A read of the DHT, shared by whoever asks while one runs, at most one per heartbeat."""
        if self._reading is None or self._reading.done():
            wait = max(0.0, self._read_at + self.heartbeat_s - time.monotonic())
            self._reading = asyncio.create_task(self._read_after(wait))
        return self._reading

    async def _read_after(self, wait: float) -> None:
        await asyncio.sleep(wait)
        await self.read_dht(beam_size=1)

    async def _discover_periodically(self) -> None:
        """Every :func:`share_period_s` of ``ttl_s``; every heartbeat while we know no other peer (peers that start
        together each find nobody at first, and push to nobody)."""
        while True:
            alone = not self._push_targets()
            period = self.heartbeat_s if alone else share_period_s(self.ttl_s, len(self._live()))
            await asyncio.sleep(max(0.0, self._read_at + period - time.monotonic()))
            if time.monotonic() - self._read_at >= period:
                if alone or not self.node.protocol.routing_table.peer_id_to_uid:
                    self._rejoin_soon()  # in the background: a read does not wait for pings that time out
                await self.read_dht(beam_size=2 if alone else 1)

    def _rejoin_soon(self) -> asyncio.Task:
        """:meth:`rejoin`, at most once per ``REJOIN_S``, shared by whoever asks while one runs."""
        if self._rejoining is None or self._rejoining.done():
            wait = max(0.0, self._rejoined_at + REJOIN_S - time.monotonic())
            self._rejoining = asyncio.create_task(self._rejoin_after(wait))
        return self._rejoining

    async def _rejoin_after(self, wait: float) -> None:
        await asyncio.sleep(wait)
        try:
            await self.rejoin()
        except Exception as e:  # never the end of discovery: the next try comes
            log.warning("could not look for the peers we lost", error=repr(e))

    async def rejoin(self) -> None:
        """While we know no live peer or our DHT routing table is empty, ping the swarm's initial peers and
        every peer whose record we have read that we hold no live record of: each that answers is in our
        routing table again, and we in its. And push our record to every peer we heard from in the last
        ``FORGET_S`` (and that did not say it left) but hold no live record of: it takes it (we are a member
        to it), and pushes its own to us with its next change.

        The pushes: after an outage, reads of the DHT can miss a peer's record for good, each node's routing
        table holding another part of the swarm. In 1 of 4 verifiable runs of bench.split two pairs of peers
        never saw each other again (every peer saw 3 of 4), and every round after the cut was void.

        hivemind drops a node from the routing table when a call to it fails, and never asks its initial peers
        again after it started. A network outage that outlasts a few calls (a laptop's Wi-Fi, a router's
        restart) emptied every node's table, and the swarm stayed split for good: each peer trained alone to
        the end (4 real peers in network namespaces, links down 15 s: benchmarks.md, A split). A peer whose
        addresses we were never given is dialled by its id: p2pd keeps the addresses of a peer it was
        connected to for some minutes after it lost it, not for good."""
        now = self._rejoined_at = time.monotonic()
        live = set(self._live())
        for pid, heard in list(self._heard_at.items()):  # forgotten, as p2pd forgets their addresses
            if now - heard >= FORGET_S:
                del self._heard_at[pid]
                if pid not in live:
                    self.members.discard(pid)
        lost = sorted(p for p in self._heard_at if p not in live and p != self.me)
        if not self._push_targets() or not self.node.protocol.routing_table.peer_id_to_uid:
            targets: dict[PeerID, list[Multiaddr]] = {}
            for maddr in self.initial_peers:
                with contextlib.suppress(Exception):
                    pid = PeerID.from_base58(maddr["p2p"])
                    targets.setdefault(pid, []).append(maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}")))
            for member in sorted(self.members - live):
                with contextlib.suppress(Exception):
                    targets.setdefault(PeerID.from_base58(member), [])
            targets.pop(self.node.peer_id, None)
            await asyncio.gather(*(self._ping(pid, maddrs) for pid, maddrs in targets.items()))
        if self._own is not None and lost:
            await asyncio.gather(*self._push_all(lost, self._own.wire()))

    async def _ping(self, pid: PeerID, maddrs: list[Multiaddr]) -> None:
        try:
            if maddrs:
                await asyncio.wait_for(self.node.p2p._client.connect(pid, maddrs), PUSH_TIMEOUT_S)
            await asyncio.wait_for(self.node.protocol.call_ping(pid), PUSH_TIMEOUT_S)
        except Exception as e:  # not back yet: the next try comes
            log.debug("could not reach a peer to rejoin through", peer=str(pid), error=repr(e))

    # ------------------------------------------------------------------------------ publishing

    async def publish(self, wire: dict[str, Any], *, urgent: bool = True, wait: bool = False) -> None:
        """Take our new record; push it to every peer we know if it is ``urgent`` (or they have not heard from
        us for ``record_ttl_s / 3``), and store it (signed) in the DHT every ``record_ttl_s / 3``.

        ``wait``: return once the pushes and the store are done (our goodbye), not as soon as they are sent.
        """
        record = ProgressRecord.parse_obj(wire)
        self._own = record
        self._take(record, get_dht_time() + self.ttl_s)
        now = time.monotonic()
        tasks = []
        first = self._stored_at == -float("inf")
        if first or record.state == PeerState.LEFT or now - self._stored_at >= self.ttl_s / 3:
            self._stored_at = now
            store = self._background(self.store(self.key, self.subkey, wire, get_dht_time() + self.ttl_s))
            if first:  # a peer that reads our push finds us in the DHT, where members come from
                await store
            tasks.append(store)
        if urgent or now - self._pushed_at >= self.ttl_s / 3:
            self._pushed_at = now
            tasks += self._push_all(self._push_targets(), wire)
        # A peer that sees more peers than we know of, or others: someone we have not heard from is out there.
        mine = view_hash(self._live())
        if any(
            e.record.view and e.record.view != mine for e in self.entries.values() if e.record is not record
        ):
            self._read_soon()
            self._rejoin_soon()
        if wait and tasks:
            await asyncio.wait(tasks, timeout=PUSH_TIMEOUT_S)

    def _background(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)
        return task

    def _live(self) -> list[str]:
        now = get_dht_time()
        return [p for p, e in self.entries.items() if e.record.state != PeerState.LEFT and e.expires >= now]

    def _push_targets(self) -> list[str]:
        return [p for p in self._live() if p != self.me]

    def _push_all(self, peers: list[str], wire: dict[str, Any]) -> list[asyncio.Task]:
        message = MSGPackSerializer.dumps({"record": compact(wire), "ttl": self.ttl_s})
        return [self._background(self._push(pid, message)) for pid in peers]

    async def _push(self, pid: str, message: bytes) -> None:
        self.traffic.pushes_sent += 1
        try:
            answer = await asyncio.wait_for(
                self.node.p2p._client.call_unary_handler(PeerID.from_base58(pid), PUSH_PROTOCOL, message),
                PUSH_TIMEOUT_S,
            )
        except Exception as e:  # gone, or slow: its record expires unless it speaks again
            self.traffic.pushes_failed += 1
            log.debug("push failed", peer=pid[-8:], error=repr(e))
            return
        if answer:  # it did not know us: its record, so that we know the swarm at once too
            self._take_pushed(pid, answer)

    async def _on_push(self, request: bytes, remote: PeerID) -> bytes:
        sender = remote.to_base58()
        known = sender in self.members
        if not known:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._read_soon()), PUSH_TIMEOUT_S / 2)
        if sender not in self.members:
            self.traffic.pushes_refused += 1
            log.debug("refused a push from a peer with no record in the DHT", peer=sender[-8:])
            return b""
        self._take_pushed(sender, request)
        if known or self._own is None:
            return b""
        return MSGPackSerializer.dumps({"record": compact(self._own.wire()), "ttl": self.ttl_s})

    def _take_pushed(self, sender: str, message: bytes) -> None:
        """A record ``sender`` pushed (or answered with): taken if it is a valid record of ``sender``'s."""
        if sender not in self.members:  # an answer from a peer we never read a signed record of
            return
        try:
            if len(message) > MAX_PUSH_BYTES:
                raise ValueError(f"{len(message)} bytes")
            body = MSGPackSerializer.loads(message)
            record = ProgressRecord.parse_obj(body["record"])
            ttl = min(float(body["ttl"]), 2 * self.ttl_s)
            if record.peer_id != sender or not ttl > 0:
                raise ValueError("a record of another peer, or no time to live")
        except Exception as e:
            self.traffic.pushes_refused += 1
            log.debug("refused a malformed push", peer=sender[-8:], error=repr(e)[:200])
            return
        self.traffic.pushes_taken += 1
        self._take(record, get_dht_time() + ttl)

    async def store(self, key: str, subkey: bytes, value: Any, expiration: float) -> None:
        """Store a signed value of ours on the :data:`REPLICAS` nodes nearest to ``key``: our record, or the
        run's experiment (``swarm.Swarm.carry_experiment``). A failed store is logged; the value ages until the
        next one, and pushes keep our peers informed meanwhile."""
        count = self._stores[key] = self._stores.get(key, 0) + 1
        self.traffic.dht_stores += 1
        try:
            if count % SEARCH_EVERY == 1:
                self.traffic.dht_searches += 1
                await self.node.store(key, value, expiration, subkey=subkey, beam_size=REPLICAS)
            else:
                await self._store_nearest(key, subkey, value, expiration)
        except Exception as e:
            log.warning("value not stored in the DHT", key=key, error=repr(e))

    async def _store_nearest(self, key: str, subkey: bytes, value: Any, expiration: float) -> None:
        """hivemind's store without its search: sign the value as it does, then send it to the nearest nodes
        our routing table knows (ourselves included, if we are among them)."""
        protocol, key_id = self.node.protocol, DHTID.generate(source=key)
        serialized = protocol.serializer.dumps(value)
        record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), serialized, expiration)
        if protocol.record_validator is not None:
            record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
        known = dict(
            protocol.routing_table.get_nearest_neighbors(key_id, REPLICAS, exclude=self.node.node_id)
        )
        nearest = sorted([*known, self.node.node_id], key=key_id.xor_distance)[:REPLICAS]
        calls = []
        for node_id in nearest:
            if node_id == self.node.node_id:
                if protocol.record_validator is None or protocol.record_validator.validate(record):
                    protocol.storage.store(key_id, record.value, expiration, subkey=subkey)
            else:
                calls.append(
                    protocol.call_store(
                        known[node_id],
                        keys=[key_id],
                        values=[record.value],
                        expiration_time=[expiration],
                        subkeys=[subkey],
                    )
                )
        await asyncio.gather(*calls, return_exceptions=True)
