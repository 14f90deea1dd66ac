"""Peers crash (kill -9) mid-round, half the swarm at once, and come back: the rest finish together.

After each: the survivors finish every round with identical params that beat the initial model's validation
loss, no outer step is applied twice, and no child process of a killed peer is left behind.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from p2ptrain import checkpoint
from tests.integration.conftest import PeerProcess, join_args, val_losses, wait_until_gone

pytestmark = pytest.mark.integration


def start_swarm(
    tmp_path, spawn, n: int, *extra: str, env: dict[int, dict[str, str]] | None = None
) -> tuple[list[PeerProcess], Callable[[int], list[str]]]:
    """n peers of one fresh run: the first bootstraps, the others join it; they start together."""
    run_id = f"t{uuid.uuid4().hex[:8]}"
    maddr = ""

    def args(i: int) -> list[str]:
        joining = ["--initial-peers", maddr] if i > 0 else []
        return join_args(tmp_path, f"p{i}", run_id, "--set", f"swarm.min_peers={n}", *extra, *joining)

    peers = []
    for i in range(n):
        peers.append(spawn(*args(i), name=f"p{i}", env=(env or {}).get(i)))
        if i == 0:
            maddr = peers[0].wait_for_maddr()
    for p in peers:
        p.wait_for_maddr()
        p.remember_descendants()
    return peers, args


def wait_until(predicate: Callable[[], bool], peers: list[PeerProcess], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for p in peers:
            assert p.proc.poll() is None, f"{p.log_path.name} exited: {p.log_path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, peers[0].log_path.read_text()[-2000:]
        time.sleep(0.1)


def assert_finished_together(tmp_path, peers: dict[str, PeerProcess], rounds: int) -> None:
    for name, p in peers.items():
        assert p.wait(240) == 0, f"{name}: {p.log_path.read_text()[-3000:]}"
    finals = {name: checkpoint.load(tmp_path / name / "final.safetensors") for name in peers}
    assert {f.round for f in finals.values()} == {rounds}
    assert len({f.params_sha256() for f in finals.values()}) == 1, "survivors disagree on the final params"
    for name, p in peers.items():
        done = [s["round"] for s in p.outer_steps()]
        assert done == sorted(set(done)), f"{name} applied an outer step twice: {done}"
    # The swarm learned: the final params (the same on every survivor) against the initial model. Not the
    # last logged round of each peer: a late joiner logs only its last rounds, and a peer whose last sync
    # failed logs that round and then loads the swarm's final state.
    initial, final = val_losses(next(iter(finals.values())))
    assert final < initial - 0.5, f"validation loss {initial:.4f} -> {final:.4f}"


def assert_no_orphans(victims: list[PeerProcess]) -> None:
    for v in victims:
        assert not wait_until_gone(v.descendants, timeout_s=60), f"{v.log_path.name}'s children outlived it"


def test_kill9_during_the_inner_phase_then_restart(tmp_path, spawn):
    rounds = 6
    peers, args = start_swarm(
        tmp_path,
        spawn,
        3,
        "--set",
        "inner.num_inner_steps=300",
        "--set",
        f"outer.num_rounds={rounds}",
        "--set",
        "checkpoint.every_rounds=1",
    )
    victim = peers[2]
    wait_until(lambda: any(s["round"] >= 1 for s in victim.outer_steps()), peers)
    time.sleep(1.0)  # well inside its next inner phase (300 steps take several seconds here)
    victim.proc.kill()
    victim.proc.wait()
    assert max(s["round"] for s in victim.outer_steps()) == 1, "the kill should land in round 2's inner phase"
    assert_no_orphans([victim])

    # The survivors go on without it; restarted on its own checkpoint dir, it resumes and then loads the
    # swarm's newer state rather than training on from its stale checkpoint.
    restarted = spawn(*args(2), name="p2-restarted")
    assert_finished_together(tmp_path, {"p0": peers[0], "p1": peers[1], "p2": restarted}, rounds)
    events = [e["event"] for e in restarted.events()]
    assert "resumed from checkpoint" in events and "loaded state" in events, events
    survivors_after_kill = [s for s in peers[0].outer_steps() if s["round"] >= 2]
    assert any(s["group_size"] >= 2 for s in survivors_after_kill), "the survivors stopped averaging together"


def test_kill9_during_the_allreduce(tmp_path, spawn):
    rounds = 5
    peers, _ = start_swarm(
        tmp_path,
        spawn,
        3,
        "--set",
        "inner.num_inner_steps=40",
        "--set",
        f"outer.num_rounds={rounds}",
        env={2: {"P2PTRAIN_FAILPOINT": "allreduce:2"}},  # dies half-way through its second all-reduce
    )
    victim = peers[2]
    assert victim.wait(120) == -9, victim.log_path.read_text()[-3000:]
    assert any(e["event"].startswith("failpoint") for e in victim.events())
    assert_finished_together(tmp_path, {"p0": peers[0], "p1": peers[1]}, rounds)
    assert_no_orphans([victim])


def test_half_the_swarm_killed_at_once(tmp_path, spawn):
    rounds = 5
    peers, _ = start_swarm(
        tmp_path, spawn, 4, "--set", "inner.num_inner_steps=150", "--set", f"outer.num_rounds={rounds}"
    )
    wait_until(lambda: all(any(s["round"] >= 1 for s in p.outer_steps()) for p in peers), peers)
    victims = peers[2:]
    for v in victims:
        v.proc.kill()
    for v in victims:
        v.proc.wait()
    assert_finished_together(tmp_path, {"p0": peers[0], "p1": peers[1]}, rounds)
    after = [s for s in peers[0].outer_steps() if s["round"] >= 3]
    assert any(s["group_size"] == 2 for s in after), "the two survivors should go on averaging together"
    assert_no_orphans(victims)


def test_donor_killed_mid_transfer_the_newcomer_takes_the_state_from_another(tmp_path, spawn):
    rounds = 6
    run_id = f"t{uuid.uuid4().hex[:8]}"
    # Rounds of a few seconds, so that the swarm is still running when the newcomers have started.
    slow = ["--set", "inner.num_inner_steps=300", "--set", f"outer.num_rounds={rounds}"]
    armed = tmp_path / "armed"
    # Once `armed` exists, p0 dies by SIGKILL half-way through the next download it serves.
    first = spawn(
        *join_args(tmp_path, "p0", run_id, *slow), name="p0", env={"P2PTRAIN_FAILPOINT": f"donate:@{armed}"}
    )
    maddr = first.wait_for_maddr()
    first.remember_descendants()
    wait_until(lambda: any(s["round"] >= 1 for s in first.outer_steps()), [first])
    second = spawn(*join_args(tmp_path, "p1", run_id, *slow, "--initial-peers", maddr), name="p1")
    wait_until(lambda: any(e["event"] == "outer step" for e in second.events()), [first, second])
    # p0 has trained longest, so a newcomer asks it first.
    armed.touch()
    third = spawn(*join_args(tmp_path, "p2", run_id, *slow, "--initial-peers", maddr), name="p2")
    assert first.wait(120) == -9, first.log_path.read_text()[-3000:]
    assert_finished_together(tmp_path, {"p1": second, "p2": third}, rounds)
    second_id = next(e["peer_id"] for e in second.events() if e["event"] == "peer started")
    loaded = [e for e in third.events() if e["event"] == "loaded state"]
    assert loaded and loaded[0]["donor"] == second_id[-8:], loaded
    # The half-sent state was not used: hivemind hands over a truncated download without an error, and the
    # checksum refuses it (or the stream breaks and the download fails), then the next donor serves it.
    first_id = next(e["peer_id"] for e in first.events() if e["event"] == "peer started")
    failed = [e for e in third.events() if e["event"] in ("refused a state", "state download failed")]
    assert failed and failed[0]["donor"][-8:] == first_id[-8:], failed
    assert any(e["event"].startswith("failpoint") for e in first.events())
    assert_no_orphans([first])
