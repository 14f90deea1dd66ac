"""What one DHT node keeps: each key's value small enough to answer a read with, and all of it bounded.

A DHT node answers a read of a key with everything it holds under it, in one libp2p message of at most
4 MiB (p2pd's ``persistent_conn_max_msg_size``). hivemind's node keeps whatever a holder of the swarm key
stores, without limit. So a key holder with 54 identities, each storing a progress record of the largest
size the schema allows (78 kB signed), made every read of the run's records fail on the nodes that held
them (a newcomer or a restarted peer then found nobody) for as long as those records lived; a swarm of
some 700 honest peers in verifiable rounds (about 6 kB a record) would have done the same. And any key
holder could fill every node's memory with keys of its own, kept as long as it asked.

:class:`BoundedStorage` replaces hivemind's ``DHTLocalStorage`` in every node of ours (``swarm.WatchedDHT``):

- **A key's value** (all its subkeys together) holds at most :data:`MAX_KEY_BYTES` in at most
  :data:`MAX_SUBKEYS` entries. A store that would go over drops the entries stored longest ago until it fits
  (:func:`to_drop`). Every peer stores its record again every ``swarm.record_ttl_s / 3``, so a flood pushes
  an honest record out only while the flooder stores more than that on the node in every such period
  (3 MiB every 6.7 s by default, about 470 kB/s), and a read always fits in one answer.
- **Other keys** (neither the run's progress records nor its published experiments: hivemind's
  matchmaking, another run's records, or whatever a key holder makes up) hold at most
  :data:`MAX_OTHER_BYTES` in at most :data:`MAX_OTHER_KEYS` keys together, the keys stored longest ago
  dropped first, and none is kept longer than :data:`MAX_OTHER_TTL_S`.
- **hivemind's cache** never holds the run's keys: a node answers a read from its cache in place of its
  storage when the cached copy expires later, so one record cached with a long life would have hidden every
  record the node stores (a store may ask to be cached: ``in_cache``). Our reads always ask for the latest
  value and nothing is cached on purpose (``swarm.DHT_TUNING``).

- **A node's own read** merges the other nodes' answers into a copy, not into what its storage holds
  (:func:`reading_a_copy`), and hivemind's expiry heaps are rebuilt as they outgrow what is held
  (:func:`compact`). :func:`install` sets all of this up in the DHT child.

Every store costs at most a pass over one key's :data:`MAX_SUBKEYS` entries and the :data:`MAX_OTHER_KEYS`
other keys, whatever is held: sizes are counted once, when an entry arrives.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import TimedStorage, ValueWithExpiration, get_dht_time

from p2ptrain.logs import get_logger

log = get_logger(__name__)

MAX_KEY_BYTES = 3 * 2**20
"""The most one key's value holds on one node: an answer of 4 MiB, less a quarter for its framing and the
nearest peers it lists. About 2,400 records of a swarm out of verifiable rounds (1.3 kB signed), 510 in
verifiable rounds of a few peers (6.1 kB), 40 of the largest the schema allows (78 kB)."""

MAX_SUBKEYS = 4096
"""The most entries one key holds on one node (tiny entries would otherwise make each store's bookkeeping
long)."""

MAX_OTHER_BYTES = 32 * 2**20
"""The most a node keeps under keys other than the run's, all of them together."""

MAX_OTHER_KEYS = 4096
"""The most keys other than the run's a node keeps."""

MAX_OTHER_TTL_S = 600.0
"""The longest a node keeps a value under a key other than the run's (hivemind's matchmaking asks for
seconds); the run's own keys have ``swarm.MAX_RECORD_TTL_S``, checked by their validators."""

ENTRY_BYTES = 32
"""What a subkey costs in an answer besides its subkey and value (its expiration, msgpack's framing)."""

WARN_EVERY_S = 60.0
"""A node that drops or refuses values says so at most this often (with the counts since it last did)."""


def size_of(subkey: Any, value: Any) -> int:
    """The bytes a subkey's entry takes in an answer."""
    return len(MSGPackSerializer.dumps(subkey)) + len(value) + ENTRY_BYTES


def to_drop(
    held: Mapping[Hashable, int], total: int, new: Hashable, size: int, budget: int, most: int
) -> list[Hashable] | None:
    """Which entries of a key to drop so that ``new``'s entry of ``size`` bytes fits in ``budget`` bytes and
    ``most`` entries: the ones stored first first; None if it cannot fit (it alone is over the budget).

    Args:
        held: the key's entries now, by subkey, in the order they were stored (oldest first), with their
            bytes. ``new``'s old entry, if any, is replaced, not dropped.
        total: the bytes of ``held`` (kept with it, so that a store takes no pass over every entry).
    """
    if size > budget:
        return None
    total += size - held.get(new, 0)
    count = len(held) + (new not in held)
    drop = []
    for k, nbytes in held.items():
        if total <= budget and count <= most:
            break
        if k != new:
            drop.append(k)
            total, count = total - nbytes, count - 1
    return drop


class _Ledger:
    """One dictionary key's entries in the order they were stored, with their bytes and the sum of them."""

    def __init__(self, entries: Mapping[Any, int] = {}):  # noqa: B006  # read only
        self.entries: OrderedDict[Any, int] = OrderedDict(entries)
        self.total = sum(self.entries.values())

    def drop(self, subkey: Any) -> None:
        self.total -= self.entries.pop(subkey, 0)

    def add(self, subkey: Any, size: int) -> None:
        """As the latest store (an entry stored again moves to the end)."""
        self.drop(subkey)
        self.entries[subkey] = size
        self.total += size


def install(kept: Collection[DHTID]) -> None:
    """Bound this process's DHT node (call it in the DHT child, before the node is made): its storage and
    cache are :class:`BoundedStorage`, and its reads leave the storage alone (:func:`reading_a_copy`)."""
    from hivemind.dht import node as dht_node
    from hivemind.dht import protocol as dht_protocol

    dht_protocol.DHTLocalStorage = make_storage(kept)  # type: ignore[misc,assignment]
    dht_node._SearchState.add_candidate = reading_a_copy(dht_node._SearchState.add_candidate)  # type: ignore[method-assign]


def reading_a_copy(add_candidate: Callable) -> Callable:
    """hivemind's ``_SearchState.add_candidate``, adopting a copy of a dictionary value, not the value itself.

    A read of a key starts from the node's own storage and merges every other node's answer into the first
    dictionary it found: the very one the storage holds. So a read wrote whatever the others answered into the
    storage, past every bound here (a holder of the run's key read three nodes' worth into it, over what one
    answer holds), and an older copy of an entry merged in took the newer one's place in hivemind's expiry
    order, which then dropped it early."""

    def add_candidate_copy(self: Any, candidate: Any, source_node_id: Any) -> Any:
        if (
            candidate is not None
            and isinstance(candidate.value, DictionaryDHTValue)
            and not isinstance(self.binary_value, DictionaryDHTValue)
        ):
            candidate = ValueWithExpiration(_copy(candidate.value), candidate.expiration_time)
        return add_candidate(self, candidate, source_node_id)

    return add_candidate_copy


def _copy(value: DictionaryDHTValue) -> DictionaryDHTValue:
    copy = DictionaryDHTValue(value.maxsize)
    for subkey, item in value.items():
        copy.store(subkey, item.value, item.expiration_time)
    copy.latest_expiration_time = value.latest_expiration_time
    return copy


def compact(storage: TimedStorage) -> None:
    """Rebuild hivemind's expiry heap of ``storage`` once it holds more than twice the entries held: every store
    adds to it, and an entry replaced or dropped stays in it until its own expiration (up to 10 minutes), so
    stores alone made it grow without bound. Amortized, a constant cost a store."""
    if len(storage.expiration_heap) > 2 * len(storage.data) + 64:
        storage.expiration_heap = list(storage.key_to_heap.values())
        heapq.heapify(storage.expiration_heap)


def make_storage(kept: Collection[DHTID]):
    """A stand-in for hivemind's ``DHTLocalStorage`` class: ``DHTProtocol.create`` makes the node's storage
    with no argument and its cache with the keyword ``maxsize`` (None by default: hivemind 1.1.12, which we
    pin)."""

    def make(**kwargs: Any) -> BoundedStorage:
        return BoundedStorage(kwargs.get("maxsize"), kept=kept, cache="maxsize" in kwargs)

    return make


class BoundedStorage(DHTLocalStorage):
    """hivemind's ``DHTLocalStorage`` within the bounds above (the module's docstring).

    Args:
        maxsize: hivemind's (the number of keys; its cache has one).
        kept: the run's keys (progress records, published experiments): bounded per key only, so that no
            other key can crowd them out.
        cache: hivemind's cache, which never holds ``kept`` keys.
    """

    def __init__(
        self,
        maxsize: int | None = None,
        *,
        kept: Collection[DHTID] = (),
        cache: bool = False,
        key_bytes: int = MAX_KEY_BYTES,
        other_bytes: int = MAX_OTHER_BYTES,
    ):
        super().__init__(maxsize)
        self.kept, self.cache = frozenset(kept), cache
        self.key_bytes, self.other_bytes = key_bytes, other_bytes
        self.dropped = self.refused = 0
        """Entries or keys dropped to make room; stores refused for a bound (counted for tests and logs)."""
        self._entries: dict[DHTID, _Ledger] = {}
        """Each dictionary key's entries in the order they were stored, with their bytes."""
        self._others: OrderedDict[DHTID, int] = OrderedDict()
        """The keys other than the run's, in the order they were last stored to, with their bytes."""
        self._other_total = 0
        self._warned_at = -float("inf")
        self._warned_counts = (0, 0)

    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        """hivemind's; ``value`` is bytes, or a whole dictionary (hivemind's cache stores those)."""
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        current = self.get(key)
        if self.cache and key in self.kept:
            return False
        if expiration_time < get_dht_time() or (
            current is not None and current.expiration_time >= expiration_time
        ):
            return False  # hivemind's own storage refuses it: nothing is dropped for it
        if isinstance(value, DictionaryDHTValue):
            ledger = _Ledger({k: size_of(k, item.value) for k, item in value.items()})
            size = ledger.total
            if len(ledger.entries) > MAX_SUBKEYS:
                return self._refuse()
        else:
            ledger, size = None, len(value)
        if size > self.key_bytes or not self._room_for(key, size, expiration_time):
            return self._refuse()
        stored = super().store(key, value, expiration_time)
        if stored:
            self._stored(key, size, ledger)
        compact(self)
        return stored

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        if self.cache and key in self.kept:
            return False
        current = self.get(key)
        if self._refused_by_hivemind(expiration_time, current):
            return False
        entries = (
            current.value if current is not None and isinstance(current.value, DictionaryDHTValue) else None
        )
        if entries is not None:
            old = entries.get(subkey)
            if old is not None and old.expiration_time >= expiration_time:
                return False  # hivemind keeps the entry that expires later: nothing changes
        ledger = self._ledger(key, entries)
        size = size_of(subkey, value)
        drop = to_drop(ledger.entries, ledger.total, subkey, size, self.key_bytes, MAX_SUBKEYS)
        if drop is None:
            return self._refuse()
        after = ledger.total + size - ledger.entries.get(subkey, 0) - sum(ledger.entries[k] for k in drop)
        if not self._room_for(key, after, expiration_time):
            return self._refuse()
        if entries is not None and drop:
            for k in drop:
                del entries[k]
                ledger.drop(k)
            self._count(dropped=len(drop))
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored:
            ledger.add(subkey, size)
            self._stored(key, ledger.total, ledger)
            compact(self.get(key).value)
        compact(self)
        return stored

    @staticmethod
    def _refused_by_hivemind(expiration_time: float, current: Any) -> bool:
        """Whether hivemind's own storage would refuse an entry under a key whose value is ``current``
        (checked first: nothing is dropped for it)."""
        if expiration_time < get_dht_time():
            return True
        return (
            current is not None
            and not isinstance(current.value, DictionaryDHTValue)
            and current.expiration_time >= expiration_time
        )

    def _ledger(self, key: DHTID, entries: DictionaryDHTValue | None) -> _Ledger:
        """The key's ledger, without the entries that expired since the last store (every entry comes through
        here, so the ledger holds every entry held, and as many means the same ones)."""
        if entries is None:
            return _Ledger()
        ledger = self._entries.get(key)
        if ledger is None or len(ledger.entries) != len(entries):  # some expired: a pass over the key
            known = ledger.entries if ledger is not None else {}
            present = entries.data
            unknown = {k: size_of(k, item.value) for k, item in entries.items() if k not in known}
            ledger = _Ledger({**unknown, **{k: nbytes for k, nbytes in known.items() if k in present}})
        return ledger

    def _stored(self, key: DHTID, size: int, ledger: _Ledger | None) -> None:
        if ledger is not None:
            self._entries[key] = ledger
        else:
            self._entries.pop(key, None)  # a plain value replaced whatever was there
        if key not in self.kept:
            self._other_total += size - self._others.pop(key, 0)
            self._others[key] = size

    def _room_for(self, key: DHTID, size: int, expiration_time: float) -> bool:
        """Whether ``key``'s value may be ``size`` bytes, until ``expiration_time``; makes room among the other
        keys by dropping those stored longest ago."""
        if key in self.kept:
            return True
        if expiration_time > get_dht_time() + MAX_OTHER_TTL_S or size > self.other_bytes:
            return False
        held = len(self.data) - sum(k in self.data for k in self.kept)  # self.get dropped what expired
        if len(self._others) != held:  # some expired since: a pass over the other keys
            for gone in [k for k in self._others if k not in self.data]:
                self._other_total -= self._others.pop(gone)
                self._entries.pop(gone, None)
        total = self._other_total - self._others.get(key, 0) + size
        count = len(self._others) + (key not in self._others)
        dropped = 0
        while total > self.other_bytes or count > MAX_OTHER_KEYS:
            oldest = next(k for k in self._others if k != key)
            nbytes = self._others.pop(oldest)
            self._other_total -= nbytes
            total, count = total - nbytes, count - 1
            del self[oldest]
            self._entries.pop(oldest, None)
            dropped += 1
        if dropped:
            self._count(dropped=dropped)
        return True

    def _refuse(self) -> bool:
        self._count(refused=1)
        return False

    def _count(self, *, dropped: int = 0, refused: int = 0) -> None:
        self.dropped += dropped
        self.refused += refused
        if time.monotonic() - self._warned_at >= WARN_EVERY_S:
            last_dropped, last_refused = self._warned_counts
            log.warning(
                "this DHT node dropped the oldest entries of a full key, or refused a store over its bounds",
                dropped=self.dropped - last_dropped,
                refused=self.refused - last_refused,
                key_bytes=self.key_bytes,
                other_bytes=self.other_bytes,
            )
            self._warned_at, self._warned_counts = time.monotonic(), (self.dropped, self.refused)
