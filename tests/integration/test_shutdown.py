"""Signals: a peer stops within seconds and takes its DHT child and p2pd with it."""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest

from tests.integration.conftest import children_of, join_args, processes_named, wait_until_gone

pytestmark = pytest.mark.integration


def start_training_peer(tmp_path, spawn):
    long = ["--set", "outer.num_rounds=1000"]
    peer = spawn(*join_args(tmp_path, "p", f"t{uuid.uuid4().hex[:8]}", *long), name="peer")
    peer.wait_for_maddr()
    deadline = time.monotonic() + 60
    while '"event": "outer step"' not in peer.log_path.read_text():
        assert time.monotonic() < deadline, peer.log_path.read_text()[-2000:]
        time.sleep(0.2)
    descendants = children_of(peer.proc.pid)
    assert descendants & processes_named("p2pd"), "the peer should own a p2pd"
    return peer, descendants


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_peer_and_its_children_within_seconds(tmp_path, spawn, sig):
    peer, descendants = start_training_peer(tmp_path, spawn)
    t0 = time.monotonic()
    peer.proc.send_signal(sig)
    assert peer.wait(20) == 0
    assert time.monotonic() - t0 < 20
    assert not wait_until_gone(descendants, timeout_s=10), "DHT child, averager or p2pd outlived the peer"
    events = [json.loads(x) for x in peer.log_path.read_text().splitlines() if x.startswith("{")]
    assert not [e for e in events if e.get("level") == "error"], [
        e for e in events if e.get("level") == "error"
    ]
    assert (tmp_path / "p" / "interrupted.safetensors").is_file(), "a stopped peer keeps its work"


def test_sigkill_of_the_main_process_leaves_no_p2pd(tmp_path, spawn):
    peer, descendants = start_training_peer(tmp_path, spawn)
    peer.proc.kill()
    peer.proc.wait()
    # hivemind alone would leave the DHT child and p2pd running forever; our watchdog ends them.
    assert not wait_until_gone(descendants, timeout_s=60), "children outlived a SIGKILLed peer"
