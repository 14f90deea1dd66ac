"""The records board on real DHTs (hivemind's, on 127.0.0.1): a change reaches the other peers as a push,
reading the records costs no network, a newcomer is found, a peer that dies silently is gone after its time
to live, and a stranger's push is refused."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer

from p2ptrain.board import PUSH_PROTOCOL, compact
from p2ptrain.config import SwarmConfig
from p2ptrain.membership import generate_swarm_key
from p2ptrain.records import PeerState, ProgressRecord
from p2ptrain.swarm import Swarm, stop_dht

pytestmark = pytest.mark.integration

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# Short lives, so that a silent death shows within seconds; the split warning must outlast them.
TIMING = dict(heartbeat_s=0.5, record_ttl_s=3.0, split_warning_s=30.0)


def wait_until(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def swarm(tmp_path):
    key = tmp_path / "swarm.key"
    generate_swarm_key(key)
    made: list[Swarm] = []

    def join(first: Swarm | None = None) -> Swarm:
        peers = first.visible_maddrs() if first is not None else []
        board = Swarm(
            "t", SwarmConfig(host_maddrs=LOOPBACK, initial_peers=peers, key_file=key, **TIMING), device="cpu"
        )
        made.append(board)
        board.start()
        return board

    yield join
    for board in made:
        board.shutdown()


async def _forget(dht, node, peer: str) -> None:
    """In the DHT child: drop ``peer``'s record and read the DHT no more, as a node whose reads miss a peer's
    record after an outage (its routing table holding another part of the swarm than the node that stores
    it)."""

    async def no_read(beam_size: int = 2) -> None:
        board._read_at = time.monotonic()  # as a read that found nothing: discovery sleeps its period

    board = dht._board
    board.read_dht = no_read
    board.entries.pop(peer, None)
    board._changed()  # a new version of the table: the main process reads it again


def sees(board: Swarm, peers: list[Swarm]) -> bool:
    return {p.peer_id for p in peers} <= set(board.records())


def test_changes_arrive_as_pushes_and_reading_them_costs_no_network(swarm):
    first = swarm()
    others = [swarm(first), swarm(first)]
    everyone = [first, *others]
    wait_until(lambda: all(sees(b, everyone) for b in everyone), "every peer to see every peer")

    taken_before = others[0].dht.board("traffic").pushes_taken
    first.update(state=PeerState.AVERAGING, round=7, params_hash="cd" * 8)

    def arrived() -> bool:
        return all(
            (r := b.records().get(first.peer_id)) is not None
            and r.round == 7
            and r.state == PeerState.AVERAGING
            for b in others
        )

    wait_until(arrived, "the change to reach the others")
    reads_before = first.dht.board("traffic").dht_reads
    for _ in range(200):  # a barrier's polling: the DHT child's table answers, nobody else is asked
        first.records()
    assert others[0].dht.board("traffic").pushes_taken > taken_before
    # The DHT is read now and then meanwhile (every record_ttl_s, and a heartbeat's check of views that differ
    # a moment), however slow the machine: far fewer times than once per reading of the records.
    assert first.dht.board("traffic").dht_reads - reads_before < 50


def test_a_newcomer_is_found_and_a_peer_that_dies_silently_is_gone_after_its_time_to_live(swarm):
    first = swarm()
    second = swarm(first)
    wait_until(lambda: sees(first, [second]) and sees(second, [first]), "the first two to meet")
    newcomer = swarm(second)
    wait_until(
        lambda: all(sees(b, [first, second, newcomer]) for b in (first, second, newcomer)), "a newcomer"
    )
    assert newcomer.records()[first.peer_id].state == PeerState.LOADING

    # SIGKILL-like: its DHT child goes, no goodbye is said; the others drop it once its record expires.
    second._stop.set()
    stop_dht(second.dht)
    # Each table expires it on its own clock: the last push from it may have reached one of them later.
    wait_until(
        lambda: all(second.peer_id not in b.records() for b in (first, newcomer)),
        "the dead peer to expire",
        timeout_s=30,
    )
    assert first.peer_id in newcomer.records()  # the living keep each other alive all the while


def test_a_push_from_a_node_with_no_record_in_the_run_is_refused(swarm):
    member = swarm()
    record = ProgressRecord(
        peer_id="placeholder",
        round=99,
        state=PeerState.AVERAGING,
        params_hash="ef" * 8,
        samples_round=0,
        samples_total=0,
        samples_per_s=0.0,
        last_group_size=0,
        device="cpu",
        time=time.time(),
    )

    async def push_as_stranger() -> tuple[str, bytes]:
        p2p = await P2P.create(initial_peers=member.visible_maddrs(), host_maddrs=LOOPBACK)
        try:
            me = p2p.peer_id.to_base58()
            message = MSGPackSerializer.dumps(
                {"record": compact(record.copy(update={"peer_id": me}).wire()), "ttl": 3.0}
            )
            answer = await p2p._client.call_unary_handler(
                PeerID.from_base58(member.peer_id), PUSH_PROTOCOL, message
            )
            return me, answer
        finally:
            await p2p.shutdown()

    stranger, answer = asyncio.run(push_as_stranger())
    assert answer == b""  # and no record of ours in return
    assert stranger not in member.records()
    assert member.dht.board("traffic").pushes_refused == 1


def test_two_peers_whose_reads_miss_each_other_find_each_other_through_a_push(swarm):
    """a and b forget each other and cannot read the DHT any more; c still knows both, so their views differ
    from c's: each pushes its record to the peers it heard from but holds no record of (board.rejoin), and
    the other takes it. Before 2026-12-08 they never met again (bench.split: two pairs of 4 real peers after
    an outage, every round after it void)."""
    first = swarm()
    a, b = swarm(first), swarm(first)
    everyone = [first, a, b]
    wait_until(lambda: all(sees(x, everyone) for x in everyone), "every peer to see every peer")
    # Both at once (a push from one that still knows the other would teach it again).
    done = [
        a.dht.run_coroutine(functools.partial(_forget, peer=b.peer_id), return_future=True),
        b.dht.run_coroutine(functools.partial(_forget, peer=a.peer_id), return_future=True),
    ]
    for future in done:
        future.result(timeout=30)
    wait_until(lambda: sees(a, everyone) and sees(b, everyone), "a and b to see each other again")
