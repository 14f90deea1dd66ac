"""What a real DHT node keeps under the run's key while a key holder floods it with identities of its own."""

from __future__ import annotations

import functools
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
    straight onto ``target``'s node, and one more asked to be cached there for 10 minutes (a node answers a
    read from its cache when the cached copy lives longer); how many the node took."""
    key_id = DHTID.generate(source=progress_key(run_id))
    taken = 0
    for i in range(count + 1):
        signer = RSAPrivateKey()
        validator = RSASignatureValidator(signer)
        subkey = validator.local_public_key
        cached = i == count
        expiration = get_dht_time() + (590 if cached else 60)
        value = MSGPackSerializer.dumps(largest_record(peer_id_of(signer.get_public_key())))
        record = DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(subkey), value, expiration)
        ok = await node.protocol.call_store(
            PeerID.from_base58(target),
            keys=[key_id],
            values=[validator.sign_value(record)],
            expiration_time=[expiration],
            subkeys=[subkey],
            in_cache=[cached],
        )
        taken += bool(ok and ok[0]) and not cached
    return taken


def test_a_flood_of_the_largest_records_leaves_the_runs_records_readable(tmp_path):
    """A key holder stores 60 identities' records of the largest size on the node that holds an honest peer's
    record, and one more in that node's cache: the node keeps what fits in one answer and caches none of the
    run's records, so a newcomer's read of the run finds the honest peer once it has stored its record again.
    Before, every read of the key failed (the answer was over 4 MiB) for as long as the flood's records
    lived. The key holder and the newcomer are DHT clients: the honest peer's node is the only one that
    stores the run's records, and the newcomer reads them from it."""
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
        honest.start()  # its record again every record_ttl_s / 3, as a trainer's heartbeat does
        client = SwarmConfig(
            initial_peers=honest.visible_maddrs(), host_maddrs=LOOPBACK, key_file=key, client_mode=True
        )
        flooder = create_dht(client, progress_validators("t"))
        made.append(lambda: stop_dht(flooder))
        taken = flooder.run_coroutine(
            functools.partial(_flood, target=honest.peer_id, run_id="t", count=FLOOD)
        )
        assert taken == FLOOD, "the node refused records that were each valid"
        newcomer = create_dht(client, progress_validators("t"))
        made.append(lambda: stop_dht(newcomer))
        # What the node stores answers the read: the honest record and the latest of the flood, as many as
        # fit. (Before: nothing, or only the cached record, then what hivemind's cache merged of a few.)
        deadline = time.monotonic() + 30
        while True:
            found = live_records(newcomer, "t")
            if honest.peer_id in found and len(found) > FLOOD // 2:
                break
            honest_read = honest.peer_id in found
            assert time.monotonic() < deadline, (
                f"the newcomer read {len(found)} records, honest: {honest_read}"
            )
            time.sleep(0.5)
        assert len(found) < FLOOD, "the node kept more than one answer holds"
    finally:
        for stop in reversed(made):
            stop()
