"""Signals: a peer stops within seconds, keeps its work, and takes its DHT child and p2pd with it."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from tests.integration.conftest import children_of, join_args, processes_named, wait_until_gone

pytestmark = pytest.mark.integration


def test_sigterm_and_sigint_stop_a_peer_and_its_children_within_seconds(tmp_path, spawn):
    # Two independent peers at once (two runs): one gets SIGTERM, the other SIGINT (Ctrl-C).
    peers = {
        sig: spawn(
            *join_args(tmp_path, sig.name, f"t{uuid.uuid4().hex[:8]}", "--set", "outer.num_rounds=1000")
        )
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    deadline = time.monotonic() + 90
    while not all(p.outer_steps() for p in peers.values()):
        assert time.monotonic() < deadline and all(p.proc.poll() is None for p in peers.values())
        time.sleep(0.1)
    for sig, peer in peers.items():
        descendants = children_of(peer.proc.pid)
        assert descendants & processes_named("p2pd"), "the peer should own a p2pd"
        peer.proc.send_signal(sig)
        assert peer.wait(20) == 0, peer.tail()
        assert not wait_until_gone(descendants, timeout_s=10), "DHT child, averager or p2pd outlived the peer"
        errors = [e for e in peer.events() if e.get("level") == "error"]
        assert not errors, errors
        assert (tmp_path / sig.name / "interrupted.safetensors").is_file(), "a stopped peer keeps its work"
        assert "Stopped; this peer's state is in" in peer.stdout()
