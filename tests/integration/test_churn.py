"""kill -9 of a real peer process in its inner phase: the others finish together, the killed peer's DHT
child, averager child and p2pd are gone, and restarted on its checkpoint dir it resumes and catches up.

What only real processes show is here; the round protocol's crash cases (mid-all-reduce, mid-donation, half
the swarm, after finishing) run in process, in tests/test_rounds.py.
"""

from __future__ import annotations

import time
import uuid

import pytest

from p2ptrain import checkpoint
from tests.integration.conftest import children_of, join_args, processes_named, val_losses, wait_until_gone

pytestmark = pytest.mark.integration


def test_kill9_in_the_inner_phase_leaves_no_orphans_and_the_restarted_peer_catches_up(tmp_path, spawn):
    # Enough left after the kill for the restarted peer to start while the swarm still trains: a start takes
    # about 4 s here, and overlapped rounds of 150 steps about 1 s (8 rounds left it 5 rounds: once too few).
    rounds = 20
    run_id = f"t{uuid.uuid4().hex[:8]}"
    maddr = ""

    def args(i: int) -> list[str]:
        extra = ["--set", "swarm.min_peers=3", "--set", "averaging.target_group_size=3"]
        extra += ["--set", "inner.num_inner_steps=150", "--set", f"outer.num_rounds={rounds}"]
        extra += ["--set", "checkpoint.every_rounds=1"]
        return join_args(tmp_path, f"p{i}", run_id, *extra, *(["--initial-peers", maddr] if i else []))

    peers = [spawn(*args(0), name="p0")]
    maddr = peers[0].wait_for_maddr()
    peers += [spawn(*args(i), name=f"p{i}") for i in (1, 2)]
    victim = peers[2]
    deadline = time.monotonic() + 120
    while not any(s["round"] >= 1 for s in victim.outer_steps()):
        assert victim.proc.poll() is None and time.monotonic() < deadline, victim.tail()
        time.sleep(0.1)
    victim_children = children_of(victim.proc.pid)
    assert victim_children & processes_named("p2pd"), "a peer runs a DHT child, an averager child and p2pd"
    victim.proc.kill()  # in its inner phase of round 2 (or its barrier): either way, mid-round
    victim.proc.wait()
    # hivemind alone would leave the DHT child and p2pd running forever; the watchdogs end them.
    assert not wait_until_gone(victim_children, timeout_s=60), "children outlived a SIGKILLed peer"

    # Restart once the survivors have averaged the victim's round without it: the restarted peer is then behind.
    killed_in = max(s["round"] for s in victim.outer_steps()) + 1
    deadline = time.monotonic() + 120
    while not any(s["round"] >= killed_in for s in peers[0].outer_steps()):
        assert peers[0].proc.poll() is None and time.monotonic() < deadline, peers[0].tail()
        time.sleep(0.1)
    restarted = spawn(*args(2), name="p2-restarted")
    for name, p in (("p0", peers[0]), ("p1", peers[1]), ("p2", restarted)):
        assert p.wait(240) == 0, f"{name}: {p.tail()}"
    finals = {name: checkpoint.load(tmp_path / name / "final.safetensors") for name in ("p0", "p1", "p2")}
    assert {f.round for f in finals.values()} == {rounds}
    assert len({f.params_sha256() for f in finals.values()}) == 1, "peers disagree on the final params"
    events = [e["event"] for e in restarted.events()]
    assert "resumed from checkpoint" in events and "loaded state" in events, events
    for p in (peers[0], peers[1], restarted):
        done = [s["round"] for s in p.outer_steps()]
        assert done == sorted(set(done)), f"a round applied twice: {done}"
    initial, final = val_losses(finals["p0"])
    assert final < initial - 0.5, f"validation loss {initial:.4f} -> {final:.4f}"
