"""What one DHT node keeps (dhtstorage.py): each key's value within one answer, other keys bounded."""

from __future__ import annotations

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2ptrain.dhtstorage import MAX_KEY_BYTES, MAX_OTHER_TTL_S, BoundedStorage, size_of, to_drop

RUN = DHTID.generate(source="t_progress")
OTHER = DHTID.generate(source="something_else")


def test_the_subkeys_stored_first_are_dropped_first_to_make_room():
    held = {"a": (40, 0), "b": (40, 2), "c": (40, 1)}
    assert to_drop(held, "d", 40, 120) == ["a"]
    assert to_drop(held, "d", 80, 120) == ["a", "c"]
    assert to_drop(held, "d", 40, 160) == []
    assert to_drop(held, "d", 121, 120) is None, "alone over the budget: refused, nothing dropped"
    # A subkey stored again replaces its entry: its old bytes are not counted, and it is not dropped.
    assert to_drop(held, "a", 40, 120) == []
    assert to_drop(held, "a", 60, 120) == ["c"]


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
    # A store older than the entry held changes nothing, and drops nobody to make room.
    before = storage.dropped
    assert not storage.store(RUN, b"y" * 100_000, expiration, subkey=first)
    assert storage.dropped == before and dict(storage.get(RUN).value.items())[first].value == value


def test_a_whole_value_over_the_budget_is_not_kept():
    """hivemind's cache stores a value read from other nodes whole: one over the budget would make this
    node's own answers too long, so it is not cached."""
    cache = BoundedStorage(maxsize=100, kept=[RUN])
    expiration = get_dht_time() + 60
    merged = DictionaryDHTValue()
    for i in range(50):
        merged.store(f"peer{i}".encode(), b"x" * 78_000, expiration)
    assert not cache.store(RUN, merged, expiration)
    small = DictionaryDHTValue()
    small.store(b"peer", b"x" * 1000, expiration)
    assert cache.store(RUN, small, expiration)


def test_other_keys_are_bounded_together_and_in_time():
    storage = BoundedStorage(kept=[RUN], other_bytes=10_000)
    now = get_dht_time()
    assert not storage.store(OTHER, b"x", now + MAX_OTHER_TTL_S + 10), "kept longer than asked for"
    assert storage.store(OTHER, b"x" * 6000, now + 60)
    assert not storage.store(DHTID.generate(source="more"), b"x" * 6000, now + 60)
    assert not storage.store(DHTID.generate(source="more"), b"x", now + 60, subkey=b"s" * 6000)
    # The run's keys are not crowded out by others, nor bound by their time limit (their validators are).
    assert storage.store(RUN, b"x" * 50_000, now + 60, subkey=b"peer")
    assert storage.refused == 3
