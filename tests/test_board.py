"""The records board's table without a network: what a push may carry, which record wins, when a peer is
gone. (With real DHTs and pushes between them: tests/integration/test_board.py.)"""

from __future__ import annotations

import asyncio

import pytest
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2ptrain.board import MAX_PUSH_BYTES, REPLICAS, BoardService, compact, share_period_s
from p2ptrain.records import PeerState, ProgressRecord
from p2ptrain.swarm import MAX_RECORD_TTL_S, experiment_period_s

ME, OTHER, STRANGER = "QmMe", "QmOther", "QmStranger"


class _PeerID:
    def __init__(self, text: str):
        self.text = text

    def to_base58(self) -> str:
        return self.text


class _Node:
    """What the table touches of a DHT node: its id, and reads that find nothing."""

    peer_id = _PeerID(ME)

    def __init__(self) -> None:
        self.reads = 0

    async def get(self, key, latest=False, **kwargs):
        self.reads += 1
        return None


def record(peer: str = OTHER, *, time: float = 100.0, **fields) -> ProgressRecord:
    base = dict(
        peer_id=peer,
        round=3,
        state=PeerState.TRAINING,
        params_hash="ab" * 8,
        samples_round=0,
        samples_total=480,
        samples_per_s=800.0,
        last_group_size=2,
        device="cpu",
        time=time,
    )
    return ProgressRecord(**{**base, **fields})


def push(r: ProgressRecord, ttl: float = 20.0) -> bytes:
    return MSGPackSerializer.dumps({"record": compact(r.wire()), "ttl": ttl})


def board(ttl_s: float = 20.0) -> BoardService:
    return BoardService(_Node(), key="run_progress", subkey=b"[owner:me]", ttl_s=ttl_s, heartbeat_s=2.0)


def test_a_push_leaves_out_what_is_at_its_default_and_reads_back_the_same_record():
    r = record(benchmark_samples_per_s=1800.0, numeric_class="cpu/float32")
    wire = compact(r.wire())
    assert "sketch" not in wire and "ref_round" not in wire and "trusted" not in wire
    assert {"peer_id", "round", "state", "params_hash", "time", "numeric_class"} <= wire.keys()
    assert ProgressRecord.parse_obj(wire) == r
    assert len(MSGPackSerializer.dumps(wire)) < len(MSGPackSerializer.dumps(r.wire())) * 0.8


def test_the_newest_record_wins_and_any_record_keeps_its_peer_alive():
    b = board()
    now = get_dht_time()
    b._take(record(time=100.0, round=3), now + 5)
    version, found = b.records()
    assert found[OTHER].round == 3
    assert b.records(since=version) == (version, None)  # nothing new: nothing sent over the pipe
    b._take(record(time=90.0, round=2), now + 50)  # older (a reordered push, a stale DHT copy)
    assert b.records(since=version) == (version, None)
    assert b.entries[OTHER].expires == pytest.approx(now + 50)  # but it says the peer lived then
    b._take(record(time=110.0, round=4, state=PeerState.AVERAGING), now + 5)
    version, found = b.records(since=version)
    assert found[OTHER].round == 4 and found[OTHER].state == PeerState.AVERAGING


def test_a_waiter_for_news_wakes_when_a_push_lands_and_otherwise_when_its_time_is_up():
    b = board()
    b.members.add(OTHER)
    version, _ = b.records()

    async def scenario():
        waiter = asyncio.create_task(b.news(since=version, timeout_s=30.0))
        await asyncio.sleep(0)  # it waits: nothing changed
        assert not waiter.done()
        b._take_pushed(OTHER, push(record(state=PeerState.AVERAGING)))
        woke = await asyncio.wait_for(waiter, 10.0)  # long before its 30 s
        same = await b.news(since=woke, timeout_s=0.01)  # nothing new since: back after its time
        stale = await asyncio.wait_for(b.news(since=version, timeout_s=30.0), 10.0)  # behind already: at once
        return woke, same, stale

    woke, same, stale = asyncio.run(scenario())
    assert woke == version + 1 and same == woke and stale == woke


def test_a_peer_that_says_nothing_for_its_time_to_live_is_gone_and_our_own_record_never_expires():
    b = board()
    b._take(record(peer=OTHER), get_dht_time() - 1)
    b._take(record(peer=ME), get_dht_time() - 1)
    _, found = b.records()
    assert set(found) == {ME}


def test_a_push_is_taken_only_from_a_member_only_about_itself_and_only_when_well_formed():
    b = board()
    b._take_pushed(STRANGER, push(record(peer=STRANGER)))
    assert STRANGER not in b.entries  # no signed record of it in the DHT: not a member
    b.members.add(OTHER)
    b._take_pushed(OTHER, push(record(peer=STRANGER)))  # a member speaking for another peer
    b._take_pushed(OTHER, push(record(peer=OTHER), ttl=-1.0))
    b._take_pushed(OTHER, b"\x93not msgpack")
    b._take_pushed(OTHER, MSGPackSerializer.dumps({"record": {"peer_id": OTHER, "round": -5}, "ttl": 20.0}))
    b._take_pushed(OTHER, MSGPackSerializer.dumps({"record": {}, "ttl": 20.0, "pad": b"x" * MAX_PUSH_BYTES}))
    assert b.entries == {} and b.traffic.pushes_refused == 5 and b.traffic.pushes_taken == 0
    b._take_pushed(OTHER, push(record(peer=OTHER), ttl=1e9))
    assert b.entries[OTHER].record == record(peer=OTHER)
    # A pusher cannot keep itself alive for longer than twice our own time to live.
    assert b.entries[OTHER].expires <= get_dht_time() + 2 * b.ttl_s


def test_a_push_from_a_peer_we_never_read_asks_the_dht_first_and_a_stranger_is_still_refused():
    b = board()

    async def scenario():
        class Remote:
            def to_base58(self):
                return STRANGER

        return await b._on_push(push(record(peer=STRANGER)), Remote())

    assert asyncio.run(scenario()) == b""
    assert b.node.reads == 1  # the DHT was asked whether it has a record of the stranger: no
    assert STRANGER not in b.entries and b.traffic.pushes_refused == 1


def test_the_swarm_reads_every_record_from_the_dht_as_often_whatever_its_size_and_each_peer_less_often():
    ttl = 20.0
    periods = {n: share_period_s(ttl, n) for n in (1, 2, REPLICAS, 6, 30, 300)}
    assert periods[1] == periods[2] == periods[REPLICAS] == ttl  # a small swarm: every peer every ttl
    for n in (6, 30, 300):
        assert n / periods[n] == pytest.approx(REPLICAS / ttl)  # reads per second, all peers together
    assert periods[300] > periods[30] > periods[6] > ttl


def test_every_peer_carries_the_experiment_and_the_swarm_refreshes_its_copies_as_often_whatever_its_size():
    ttl = 20.0
    assert experiment_period_s(ttl, 1) == experiment_period_s(ttl, REPLICAS) == ttl
    assert 6 / experiment_period_s(ttl, 6) == pytest.approx(REPLICAS / ttl)  # stores per second, all peers
    # However large the swarm, a copy (which lives 3 periods, at most MAX_RECORD_TTL_S) is refreshed in time.
    assert 3 * experiment_period_s(ttl, 10_000) <= MAX_RECORD_TTL_S
