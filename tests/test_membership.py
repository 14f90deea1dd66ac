"""Membership without a network: the swarm key file, the DHT authorizer's HMACs, and records bound to
their signer's identity. (On real DHTs and averagers: tests/integration/test_membership.py.)"""

import asyncio
import os
import stat
import subprocess
import sys
import time

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from p2ptrain.addrs import SwarmError
from p2ptrain.membership import (
    SwarmKeyAuthorizer,
    create_identity,
    generate_swarm_key,
    load_identity,
    peer_id_of,
    peer_id_of_owner,
    read_swarm_key,
)
from p2ptrain.records import ProgressRecord
from p2ptrain.swarm import progress_validators, records_from_dht_value


def test_keygen_writes_a_private_key_and_never_overwrites_it(tmp_path):
    path = tmp_path / "swarm.key"
    generate_swarm_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = read_swarm_key(path)
    assert len(key) == 32
    with pytest.raises(SwarmError, match="never overwritten"):
        generate_swarm_key(path)
    assert read_swarm_key(path) == key
    other = tmp_path / "other.key"
    generate_swarm_key(other)
    assert read_swarm_key(other) != key


def test_a_bad_key_file_is_a_one_line_error_naming_the_field(tmp_path):
    with pytest.raises(SwarmError, match=r"swarm.key_file .*missing.key: cannot read it"):
        read_swarm_key(tmp_path / "missing.key")
    bad = tmp_path / "bad.key"
    bad.write_text("hunter2\n")
    with pytest.raises(SwarmError, match=r"swarm.key_file .*bad.key: not a swarm key"):
        read_swarm_key(bad)


def test_keygen_command_refuses_to_overwrite_in_one_line(tmp_path):
    path = tmp_path / "k"
    first = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "keygen", str(path)], capture_output=True, text=True
    )
    assert first.returncode == 0 and path.exists()
    again = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "keygen", str(path)], capture_output=True, text=True
    )
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"error: {path} already exists; a swarm key is never overwritten"
    ]


def ping(node_id=b"x" * 20):
    return dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=node_id), validate=True)


def test_requests_pass_only_with_the_same_key_once_and_untouched():
    ours, same, theirs = (SwarmKeyAuthorizer(k) for k in (b"a" * 32, b"a" * 32, b"b" * 32))

    async def check():
        request = ping()
        await ours.sign_request(request, None)
        assert not await theirs.validate_request(request)
        assert await same.validate_request(request)
        assert not await same.validate_request(request), "a replayed request must be refused"

        tampered = ping()
        await ours.sign_request(tampered, None)
        tampered.peer.node_id = b"y" * 20
        assert not await same.validate_request(tampered)

        unsigned = ping()
        assert not await same.validate_request(unsigned)

        stale = ping()
        await ours.sign_request(stale, None)
        stale.auth.time -= 3600
        stale.auth.signature = b""
        stale.auth.signature = ours._mac(b"p2ptrain/dht-request/v1\0", stale)  # well signed, but old
        assert not await same.validate_request(stale)

    asyncio.run(check())


def test_responses_pass_only_with_the_same_key_and_for_their_request():
    ours, theirs = SwarmKeyAuthorizer(b"a" * 32), SwarmKeyAuthorizer(b"b" * 32)

    async def check():
        request, other_request = ping(), ping()
        await ours.sign_request(request, None)
        await ours.sign_request(other_request, None)
        response = dht_pb2.PingResponse(dht_time=get_dht_time(), available=True)
        await ours.sign_response(response, request)
        assert await ours.validate_response(response, request)
        assert not await ours.validate_response(response, other_request)
        forged = dht_pb2.PingResponse(dht_time=get_dht_time(), available=True)
        await theirs.sign_response(forged, request)
        assert not await ours.validate_response(forged, request)

    asyncio.run(check())


def test_the_identity_file_key_gives_the_peer_id_and_signs_records(tmp_path):
    key = create_identity(tmp_path / "id.key")
    assert load_identity(tmp_path / "id.key").to_bytes() == key.to_bytes()
    subkey = RSASignatureValidator(key).local_public_key
    assert peer_id_of_owner(subkey) == peer_id_of(key.get_public_key())
    assert peer_id_of_owner(b"[owner:not a key]") is None and peer_id_of_owner("text") is None


def test_an_identity_file_appears_whole_readable_by_its_owner_only_and_is_never_replaced(
    tmp_path, monkeypatch
):
    """hivemind writes the key in place: a peer killed mid-write left a truncated key that every later start
    refused, and the key was readable by all until its chmod; two peers starting at once each wrote theirs."""
    path = tmp_path / "id.key"
    first = create_identity(path)
    assert path.stat().st_mode & 0o077 == 0
    assert create_identity(path).to_bytes() == first.to_bytes()  # the one that is there, not a new one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id.key"]

    def killed(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        create_identity(tmp_path / "other.key")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["id.key"]


def wire(peer_id, round=3):
    return ProgressRecord(
        peer_id=peer_id,
        round=round,
        state="training",
        params_hash="ab",
        samples_round=0,
        samples_total=0,
        samples_per_s=0.0,
        last_group_size=2,
        device="cpu",
        time=time.time(),
    ).wire()


def test_a_record_counts_only_for_the_identity_that_signed_it():
    honest, hostile = RSAPrivateKey(), RSAPrivateKey()
    honest_id, hostile_id = peer_id_of(honest.get_public_key()), peer_id_of(hostile.get_public_key())
    honest_subkey = RSASignatureValidator(honest).local_public_key
    hostile_subkey = RSASignatureValidator(hostile).local_public_key
    later = get_dht_time() + 10
    found = ValueWithExpiration(
        {
            honest_subkey: ValueWithExpiration(wire(honest_id, round=3), later),
            # the hostile identity publishes a record in the honest peer's name, and one of its own
            hostile_subkey: ValueWithExpiration(wire(honest_id, round=9), later),
        },
        later,
    )
    records = records_from_dht_value(found)
    assert set(records) == {honest_id} and records[honest_id].round == 3
    found.value[hostile_subkey] = ValueWithExpiration(wire(hostile_id, round=9), later)
    assert records_from_dht_value(found)[hostile_id].round == 9


def test_no_node_stores_a_record_that_asks_to_outlive_the_cap():
    *_, cap, signer = progress_validators("run")
    from hivemind.dht.routing import DHTID

    key = DHTID.generate(source="run_progress").to_bytes()
    experiments = DHTID.generate(source="p2ptrain_experiments").to_bytes()
    other_key = DHTID.generate(source="run_diloco.0b1").to_bytes()
    now = get_dht_time()
    for capped in (key, experiments):
        assert cap.validate(DHTRecord(capped, b"s", b"v", now + 590))
        assert not cap.validate(DHTRecord(capped, b"s", b"v", now + 3600))
    assert cap.validate(DHTRecord(other_key, b"s", b"v", now + 3600)), "only records and experiments"


def test_a_message_of_deeply_nested_tuples_is_refused_not_a_crash():
    # hivemind decodes a tuple by calling msgpack again, on the C stack: 300 nested tuples (1.4 kB in a push, a
    # DHT store, a join or a state's metadata) crashed the process with SIGSEGV. In a child process: a crash
    # here must not take the test runner down with it.
    import subprocess
    import sys

    code = """
import msgpack
import p2ptrain.membership  # imported by the board and the averager: the decoder is bounded from here on
from hivemind.utils.serializer import MSGPackSerializer
inner = msgpack.packb([1])
for _ in range(300):
    inner = msgpack.packb([msgpack.ExtType(0x40, inner)])
try:
    MSGPackSerializer.loads(msgpack.packb(msgpack.ExtType(0x40, inner)))
except ValueError as e:
    print("refused:", e)
print(MSGPackSerializer.loads(MSGPackSerializer.dumps({"ok": (1, (2, (3,)))})))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-500:])
    assert out.stdout.splitlines() == [
        "refused: a msgpack message nests tuples more than 32 deep",
        "{'ok': (1, (2, (3,)))}",
    ]
