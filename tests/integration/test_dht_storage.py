"""What a real DHT node keeps under the run's key while a key holder floods it with identities of its own."""

from __future__ import annotations

import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from p2ptrain.config import SwarmConfig
from p2ptrain.membership import generate_swarm_key, peer_id_of
from p2ptrain.records import MAX_LISTED, MAX_PEER_ID, PART_DIGEST_BYTES, SKETCH_VALUES, ProgressRecord
from p2ptrain.swarm import Swarm, create_dht, live_records, progress_key, progress_validators, stop_dht

pytestmark = pytest.mark.integration

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FLOOD = 60
"""Identities of the largest record the schema allows (78 kB signed): 54 of them are over the 4 MiB one
message of a DHT node's answer holds."""


def largest_record(peer_id: str) -> dict:
    """A record of ``peer_id`` with every field at its bound (about 78 kB signed)."""
    other = "Q" * MAX_PEER_ID
    return ProgressRecord(
        peer_id=peer_id,
        round=5,
        state="training",
        params_hash="ab" * 32,
        samples_round=1,
        samples_total=1,
        samples_per_s=1.0,
        last_group_size=2,
        device="d" * 16,
        time=time.time(),
        view="v" * 16,
        group=[other] * MAX_LISTED,
        numeric_class="c" * 32,
        shard="123456789/123456789",
        replicas=[other] * 4,
        roster=[other] * MAX_LISTED,
        roster_classes=["c" * 32] * MAX_LISTED,
        parts=b"p" * (PART_DIGEST_BYTES * SKETCH_VALUES),
        sketch=b"s" * (4 * SKETCH_VALUES),
        ref_group=[other] * 4,
        ref_sketch=b"r" * (4 * SKETCH_VALUES),
        trusted=["t" * 8] * MAX_LISTED,
        struck=["s" * 16] * MAX_LISTED,
        banned=["b" * 8] * MAX_LISTED,
    ).wire()


async def _flood(_dht, node, *, target: str, run_id: str, count: int) -> int:
    """In a key holder's DHT child: store ``count`` largest records, each signed by an identity of its own,
    straight onto ``target``'s node; how many it took."""
    key_id = DHTID.generate(source=progress_key(run_id))
    taken = 0
    for _ in range(count):
        signer = RSAPrivateKey()
        validator = RSASignatureValidator(signer)
        subkey = validator.local_public_key
        expiration = get_dht_time() + 60
        value = MSGPackSerializer.dumps(largest_record(peer_id_of(signer.get_public_key())))
        record = DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(subkey), value, expiration)
        ok = await node.protocol.call_store(
            PeerID.from_base58(target),
            keys=[key_id],
            values=[validator.sign_value(record)],
            expiration_time=[expiration],
            subkeys=[subkey],
        )
        taken += bool(ok and ok[0])
    return taken


def test_a_flood_of_the_largest_records_leaves_the_runs_records_readable(tmp_path):
    """A key holder stores 60 identities' records of the largest size on the node that holds an honest peer's
    record: the node keeps what fits in one answer, so a newcomer's read of the run still finds the honest
    peer once it has stored its record again. Before, every read of the key failed (the answer was over
    4 MiB) for as long as the flood's records lived."""
    key = tmp_path / "swarm.key"
    generate_swarm_key(key)
    made: list = []
    try:
        honest = Swarm(
            "t",
            SwarmConfig(host_maddrs=LOOPBACK, key_file=key, record_ttl_s=6.0, heartbeat_s=1.0),
            device="cpu",
        )
        made.append(honest.shutdown)
        honest.publish()
        joined = SwarmConfig(initial_peers=honest.visible_maddrs(), host_maddrs=LOOPBACK, key_file=key)
        flooder = create_dht(joined, progress_validators("t"))
        made.append(lambda: stop_dht(flooder))
        taken = flooder.run_coroutine(_flood_into(honest.peer_id))
        assert taken == FLOOD, "the node refused records that were each valid"
        newcomer = create_dht(joined, progress_validators("t"))
        made.append(lambda: stop_dht(newcomer))
        deadline = time.monotonic() + 60
        while True:
            found = live_records(newcomer, "t")
            if honest.peer_id in found:
                break
            assert time.monotonic() < deadline, (
                f"the newcomer never read the honest record ({len(found)} read)"
            )
            time.sleep(0.5)
        assert len(found) < FLOOD, "the node kept more than one answer holds"
    finally:
        for stop in reversed(made):
            stop()


def _flood_into(target: str):
    import functools

    return functools.partial(_flood, target=target, run_id="t", count=FLOOD)
