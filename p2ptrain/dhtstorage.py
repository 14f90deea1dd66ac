"""What one DHT node keeps: each key's value small enough to answer a read with, and all of it bounded.

A DHT node answers a read of a key with everything it holds under it, in one libp2p message of at most
4 MiB (p2pd's ``persistent_conn_max_msg_size``). hivemind's node keeps whatever a holder of the swarm key
stores, without limit. So a key holder with 54 identities, each storing a progress record of the largest
size the schema allows (78 kB signed), made every read of the run's records fail on the nodes that held
them (a newcomer or a restarted peer then found nobody) for as long as those records lived; a swarm of
some 700 honest peers in verifiable rounds (about 6 kB a record) would have done the same. And any key
holder could fill every node's memory with keys of its own, kept as long as it asked.

:class:`BoundedStorage` replaces hivemind's ``DHTLocalStorage`` in every node of ours (``swarm.WatchedDHT``):

- **A key's value** (all its subkeys together) holds at most :data:`MAX_KEY_BYTES`. A store that would go
  over drops the subkeys stored longest ago until it fits (:func:`to_drop`). Every peer stores its record
  again every ``swarm.record_ttl_s / 3``, so a flood pushes an honest record out only while the flooder
  stores more than :data:`MAX_KEY_BYTES` on that node in every such period (about 470 kB/s by default),
  and a read always fits in one answer.
- **Other keys** (neither the run's progress records nor the published experiments: hivemind's
  matchmaking, or whatever a key holder makes up) hold at most :data:`MAX_OTHER_BYTES` together, and none
  is kept longer than :data:`MAX_OTHER_TTL_S`: a store over either is refused.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Hashable, Mapping
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2ptrain.logs import get_logger

log = get_logger(__name__)

MAX_KEY_BYTES = 3 * 2**20
"""The most one key's value holds on one node: an answer of 4 MiB, less a quarter for its framing and the
nearest peers it lists. About 2,400 records of a swarm out of verifiable rounds (1.3 kB signed), 510 in
verifiable rounds of a few peers (6.1 kB), 40 of the largest the schema allows (78 kB)."""

MAX_OTHER_BYTES = 32 * 2**20
"""The most a node keeps under keys other than the run's, all of them together."""

MAX_OTHER_TTL_S = 600.0
"""The longest a node keeps a value under a key other than the run's (hivemind's matchmaking asks for
seconds); the run's own keys have ``swarm.MAX_RECORD_TTL_S``, checked by their validators."""

ENTRY_BYTES = 32
"""What a subkey costs in an answer besides its subkey and value (its expiration, msgpack's framing)."""

WARN_EVERY_S = 60.0
"""A node that drops or refuses values says so at most this often (with the counts since it last did)."""

RECOUNT_S = 1.0
"""How often the bytes under other keys are counted again from what is held; between counts a store adds
its bytes, and what expired is not taken off, so the count errs on the full side."""


def size_of(subkey: Any, value: Any) -> int:
    """The bytes a subkey's entry takes in an answer."""
    return len(MSGPackSerializer.dumps(subkey)) + len(value) + ENTRY_BYTES


def to_drop(
    held: Mapping[Hashable, tuple[int, int]], subkey: Hashable, size: int, budget: int
) -> list[Hashable] | None:
    """Which subkeys of a key to drop so that ``subkey``'s new entry of ``size`` bytes fits in ``budget``, the
    ones stored first first; None if it cannot fit (it alone is over the budget).

    Args:
        held: the key's subkeys now, each as (bytes, arrival): arrivals order the stores, lowest first.
            ``subkey``'s old entry, if any, is replaced, not dropped.
    """
    if size > budget:
        return None
    others = sorted((arrival, k, nbytes) for k, (nbytes, arrival) in held.items() if k != subkey)
    total = size + sum(nbytes for _, _, nbytes in others)
    drop = []
    for _, k, nbytes in others:
        if total <= budget:
            break
        drop.append(k)
        total -= nbytes
    return drop


class BoundedStorage(DHTLocalStorage):
    """hivemind's ``DHTLocalStorage``, each key's value within :data:`MAX_KEY_BYTES` (the oldest subkeys go
    first) and the keys other than ``kept`` within :data:`MAX_OTHER_BYTES` and :data:`MAX_OTHER_TTL_S`.

    Args:
        maxsize: hivemind's (the number of keys; its cache has one).
        kept: the run's keys (progress records, published experiments): bounded per key only, so that no
            other key can crowd them out.
    """

    def __init__(
        self,
        maxsize: int | None = None,
        *,
        kept: Collection[DHTID] = (),
        key_bytes: int = MAX_KEY_BYTES,
        other_bytes: int = MAX_OTHER_BYTES,
    ):
        super().__init__(maxsize)
        self.kept = frozenset(kept)
        self.key_bytes, self.other_bytes = key_bytes, other_bytes
        self.dropped = self.refused = 0
        """Subkeys dropped to make room; stores refused (counted for tests and the logs)."""
        self._arrivals: dict[DHTID, dict[Any, int]] = {}
        self._clock = itertools.count()
        self._other_total = 0
        self._counted_at = -float("inf")
        self._warned_at = -float("inf")
        self._warned_counts = (0, 0)

    def store(
        self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None
    ) -> bool:  # hivemind's signature; ``value`` is bytes, or a whole dictionary (its cache stores those)
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if isinstance(value, DictionaryDHTValue):
            size = sum(size_of(k, item.value) for k, item in value.items())
        else:
            size = len(value)
        if size > self.key_bytes or not self._room_for(key, size, expiration_time):
            self._count(refused=1)
            return False
        stored = super().store(key, value, expiration_time)
        if stored:
            self._arrivals.pop(key, None)  # a new value: none of its subkeys arrived through us
        return stored

    def store_subkey(self, key: DHTID, subkey: Any, value: bytes, expiration_time: float) -> bool:
        current = self.get(key)
        entries = (
            current.value if current is not None and isinstance(current.value, DictionaryDHTValue) else None
        )
        held: dict[Any, tuple[int, int]] = {}
        if entries is not None:
            old = entries.get(subkey)
            if old is not None and old.expiration_time >= expiration_time:
                return False  # hivemind keeps the entry that expires later: nothing changes
            arrivals = self._arrivals.get(key, {})
            held = {k: (size_of(k, item.value), arrivals.get(k, -1)) for k, item in entries.items()}
        size = size_of(subkey, value)
        drop = to_drop(held, subkey, size, self.key_bytes)
        growth = size - sum(held[k][0] for k in (drop or ())) - held.get(subkey, (0, 0))[0]
        if drop is None or not self._room_for(key, growth, expiration_time):
            self._count(refused=1)
            return False
        if entries is not None and drop:
            for k in drop:
                del entries[k]
            self._count(dropped=len(drop))
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored:
            arrivals = self._arrivals.setdefault(key, {})
            for k in drop:
                arrivals.pop(k, None)
            arrivals[subkey] = next(self._clock)
        return stored

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

    def _room_for(self, key: DHTID, growth: int, expiration_time: float) -> bool:
        """Whether a value under ``key`` may grow by ``growth`` bytes and live until ``expiration_time``."""
        if key in self.kept:
            return True
        if expiration_time > get_dht_time() + MAX_OTHER_TTL_S:
            return False
        if time.monotonic() - self._counted_at >= RECOUNT_S:
            self._recount()
        if self._other_total + growth > self.other_bytes:
            return False
        self._other_total += max(growth, 0)
        return True

    def _recount(self) -> None:
        """Count the bytes under other keys from what is held; forget the arrivals of keys gone."""
        total = 0
        present = set()
        for key, item in self.items():
            present.add(key)
            if key in self.kept:
                continue
            if isinstance(item.value, DictionaryDHTValue):
                total += sum(size_of(k, entry.value) for k, entry in item.value.items())
            else:
                total += len(item.value)
        self._other_total, self._counted_at = total, time.monotonic()
        for key in self._arrivals.keys() - present:
            del self._arrivals[key]
