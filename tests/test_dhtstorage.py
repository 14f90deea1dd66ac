"""What one DHT node keeps (dhtstorage.py): each key's value within one answer, other keys bounded."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from p2ptrain.dhtstorage import (
    MAX_KEY_BYTES,
    MAX_OTHER_TTL_S,
    MAX_SUBKEYS,
    BoundedStorage,
    make_storage,
    reading_a_copy,
    size_of,
    to_drop,
)

RUN = DHTID.generate(source="t_progress")
OTHER = DHTID.generate(source="something_else")


def test_the_entries_stored_first_are_dropped_first_to_make_room():
    held = OrderedDict([("a", 40), ("c", 40), ("b", 40)])  # in the order they were stored
    drop = lambda new, size, budget, most=10: to_drop(held, 120, new, size, budget, most)  # noqa: E731
    assert drop("d", 40, 120) == ["a"]
    assert drop("d", 80, 120) == ["a", "c"]
    assert drop("d", 40, 160) == []
    assert drop("d", 40, 160, most=3) == ["a"], "at most 3 entries"
    assert drop("d", 121, 120) is None, "alone over the budget: refused, nothing dropped"
    # A subkey stored again replaces its entry: its old bytes are not counted, and it is not dropped.
    assert drop("a", 40, 120) == []
    assert drop("a", 60, 120) == ["c"]


def test_a_key_keeps_the_latest_stores_within_its_budget_and_answers_within_one_message():
    storage = BoundedStorage(kept=[RUN])
    value = b"x" * 78_000  # about a record of the largest size the schema allows
    expiration = get_dht_time() + 60
    for i in range(60):
        assert storage.store(RUN, value, expiration, subkey=f"peer{i}".encode())
    held = storage.get(RUN).value
    kept = {k.decode() for k, _ in held.items()}
    assert len(kept) == MAX_KEY_BYTES // size_of(b"peer10", value)
    assert kept == {f"peer{i}" for i in range(60 - len(kept), 60)}, "the latest stores stay"
    assert len(MSGPackSerializer.dumps(held)) <= MAX_KEY_BYTES < 4 * 2**20
    assert storage.dropped == 60 - len(kept)

    # A peer that stores its record again (a later expiration) is the latest store: the next drop spares it.
    first = min(kept, key=lambda k: int(k[4:])).encode()
    assert storage.store(RUN, value, expiration + 1, subkey=first)
    assert storage.store(RUN, value, expiration, subkey=b"newcomer")
    assert first in dict(storage.get(RUN).value.items())
    # A store hivemind refuses (older than the entry held, or already expired) drops nobody to make room.
    before = storage.dropped
    assert not storage.store(RUN, b"y" * 100_000, expiration, subkey=first)
    assert not storage.store(RUN, b"y" * 100_000, get_dht_time() - 1, subkey=b"late")
    assert storage.dropped == before and dict(storage.get(RUN).value.items())[first].value == value


def test_a_key_holds_a_bounded_number_of_entries_and_forgets_those_gone():
    """Tiny entries: the key holds at most MAX_SUBKEYS, and what the node remembers of them stays as many
    (each store's bookkeeping is a pass over at most that many)."""
    storage = BoundedStorage()
    now = get_dht_time()
    for i in range(MAX_SUBKEYS + 100):
        assert storage.store(OTHER, b"v", now + 60, subkey=i.to_bytes(2, "big"))
    assert len(storage.get(OTHER).value) == MAX_SUBKEYS and b"\0\0" not in dict(
        storage.get(OTHER).value.items()
    )
    assert len(storage._entries[OTHER].entries) == MAX_SUBKEYS
    # Entries that expired are gone from the bookkeeping at the next store.
    assert storage.store(OTHER, b"v", get_dht_time() + 0.2, subkey=b"short")
    time.sleep(0.3)  # past its expiration
    assert storage.store(OTHER, b"v", now + 60, subkey=b"next")
    ledger = storage._entries[OTHER]
    assert b"short" not in ledger.entries and len(ledger.entries) == len(storage.get(OTHER).value)
    assert ledger.total == sum(size_of(k, item.value) for k, item in storage.get(OTHER).value.items())


def test_the_cache_never_holds_the_runs_keys():
    """A node answers a read from its cache in place of its storage when the cached copy expires later: one
    record cached with a long life hid every record it stores. hivemind makes the cache with the keyword
    maxsize (None by default), the storage with none."""
    make = make_storage([RUN])
    storage, cache = make(), make(maxsize=None)
    assert not storage.cache and cache.cache
    expiration = get_dht_time() + 500
    assert not cache.store(RUN, b"x" * 1000, expiration, subkey=b"peer")
    whole = DictionaryDHTValue()
    whole.store(b"peer", b"x" * 1000, expiration)
    assert not cache.store(RUN, whole, expiration)
    assert cache.store(OTHER, whole, expiration), "other keys are cached as hivemind does"
    assert storage.store(RUN, b"x" * 1000, expiration, subkey=b"peer")
    assert cache.refused == 0, "not a bound: nothing to warn about"


def test_other_keys_are_bounded_together_the_oldest_dropped_first_and_bounded_in_time():
    storage = BoundedStorage(kept=[RUN], other_bytes=10_000)
    now = get_dht_time()
    assert not storage.store(OTHER, b"x", now + MAX_OTHER_TTL_S + 10), "kept longer than asked for"
    assert not storage.store(OTHER, b"x" * 10_001, now + 60), "alone over the bound"
    assert storage.store(OTHER, b"x" * 6000, now + 60)
    newer = DHTID.generate(source="newer")
    assert storage.store(newer, b"x" * 6000, now + 60)
    assert storage.get(OTHER) is None and storage.get(newer) is not None, "the key stored first made room"
    assert storage.store(DHTID.generate(source="dict"), b"x", now + 60, subkey=b"s" * 6000)
    assert storage.get(newer) is None
    # The run's keys are not crowded out by others, nor bound by their time limit (their validators are).
    assert storage.store(RUN, b"x" * 50_000, now + 60, subkey=b"peer")
    assert storage.refused == 2 and storage.dropped == 2


def test_a_read_merges_the_others_answers_into_a_copy_not_into_the_storage():
    """hivemind's read starts from the node's own storage and merged every other answer into that very
    dictionary: past every bound, and an older copy of an entry took the newer one's place in the expiry
    order."""
    from hivemind.dht.node import _SearchState

    storage = BoundedStorage(kept=[RUN])
    now = get_dht_time()
    assert storage.store(RUN, b"mine", now + 60, subkey=b"a") and storage.store(
        RUN, b"b", now + 60, subkey=b"b"
    )
    answer = DictionaryDHTValue()
    answer.store(b"a", b"older", now + 1)
    answer.store(b"c", b"theirs", now + 30)

    def read(add_candidate) -> _SearchState:
        async def search_in_a_loop() -> _SearchState:  # hivemind's search state makes a future
            search = _SearchState(RUN, sufficient_expiration_time=float("inf"))
            add_candidate(search, storage.get(RUN), source_node_id=None)
            add_candidate(search, ValueWithExpiration(answer, now + 30), source_node_id=None)
            return search

        return asyncio.run(search_in_a_loop())

    search = read(reading_a_copy(_SearchState.add_candidate))
    assert {k for k, _ in search.binary_value.items()} == {b"a", b"b", b"c"}
    held = dict(storage.get(RUN).value.items())
    assert set(held) == {b"a", b"b"} and held[b"a"] == ValueWithExpiration(b"mine", now + 60)
    assert storage.get(RUN).value.key_to_heap[b"a"].expiration_time == now + 60
    read(_SearchState.add_candidate)  # hivemind's own: the storage takes the answer in
    assert b"c" in dict(storage.get(RUN).value.items()), "hivemind's read no longer writes into the storage"


def test_stores_alone_do_not_grow_hivemind_s_expiry_heaps():
    storage = BoundedStorage(kept=[RUN])
    now = get_dht_time()
    for i in range(5000):
        assert storage.store(RUN, b"v", now + 60 + i * 1e-3, subkey=b"peer")
        assert storage.store(OTHER, b"v", now + 60 + i * 1e-3)
    assert len(storage.expiration_heap) <= 2 * len(storage.data) + 64
    assert len(storage.get(RUN).value.expiration_heap) <= 2 + 64
