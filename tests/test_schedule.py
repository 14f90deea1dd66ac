"""A volunteer's machine comes first: when a peer pauses (p2ptrain/schedule.py), and a paused peer in a swarm."""

from __future__ import annotations

import threading
import time
from datetime import datetime

import pytest

from p2ptrain.config import ConfigError, ScheduleConfig, load_config
from p2ptrain.records import PeerState
from p2ptrain.schedule import Machine, Reading, Schedule, pause_reason, resume_wait_s, within
from p2ptrain.trainer import Trainer
from tests.memswarm import MemorySwarm, PeerThread, fast_config
from tests.test_rounds import assert_swarm_contract, finish, slowed_steps

NOON = datetime(2026, 12, 1, 12, 0)


def test_hours_may_wrap_midnight():
    night = "22:00-07:00"
    assert within(night, datetime(2026, 1, 1, 23, 30).time()) and within(
        night, datetime(2026, 1, 1, 6, 59).time()
    )
    assert not within(night, NOON.time())
    assert within("09:00-17:00", NOON.time()) and not within(
        "09:00-17:00", datetime(2026, 1, 1, 17, 0).time()
    )


def test_each_reason_to_pause_is_named():
    cfg = ScheduleConfig(max_other_cpu=0.5, pause_on_battery=True, hours="09:00-17:00")
    assert pause_reason(cfg, Reading(other_cpu=0.2, on_battery=False, now=NOON)) is None
    assert "other processes use 80% of the CPU" in pause_reason(cfg, Reading(0.8, False, NOON))
    assert "on battery" in pause_reason(cfg, Reading(0.1, True, NOON))
    assert "outside schedule.hours 09:00-17:00" in pause_reason(
        cfg, Reading(0.1, False, datetime(2026, 1, 1, 20))
    )
    assert pause_reason(ScheduleConfig(), Reading(1.0, True, NOON)) is None, "nothing configured: never"
    assert pause_reason(cfg, Reading(None, None, NOON)) is None, "what cannot be read does not pause"


def test_a_bad_window_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"schedule\.hours: .*HH:MM-HH:MM"):
        load_config(None, {"schedule": {"hours": "22-7"}})
    # Windows that passed and then paused the peer for ever, or failed mid-run comparing with the local clock.
    for hours, says in [
        ("07:00-07:00", "starts and ends at the same time"),
        ("07:00+01:00-22:00", "without a time zone"),
    ]:
        with pytest.raises(ConfigError, match=rf"schedule\.hours: .*{says}"):
            load_config(None, {"schedule": {"hours": hours}})


class FakeMachine:
    def __init__(self, other_cpu: float = 0.0):
        self.other_cpu = other_cpu
        self.reads = 0

    def read(self) -> Reading:
        self.reads += 1
        return Reading(other_cpu=self.other_cpu, on_battery=None, now=NOON)


def test_it_pauses_at_once_and_resumes_only_after_the_machine_stayed_free():
    clock = [0.0]
    machine = FakeMachine()
    schedule = Schedule(
        ScheduleConfig(max_other_cpu=0.5, check_every_s=1, resume_after_s=10), machine, lambda: clock[0]
    )
    assert schedule.check() is None
    machine.other_cpu = 0.9
    assert schedule.check() is None and machine.reads == 1, "read at most every check_every_s"
    clock[0] = 1.0
    assert schedule.check() is not None
    machine.other_cpu = 0.1
    for t in (2.0, 6.0, 11.0):
        clock[0] = t
        assert schedule.check() is not None, f"still paused at {t}: free for {t - 2.0}s only"
    clock[0] = 12.0
    assert schedule.check() is None
    machine.other_cpu = 0.9
    clock[0] = 13.0
    assert schedule.check() is not None


def test_a_peer_that_pauses_again_right_after_resuming_waits_longer_each_time():
    """A steady load on a machine the peer shares reads above the threshold while the peer trains and below it
    while it is paused: without backoff the peer resumed every resume_after_s and paused again at its next
    reading, each time dropping a round's work and loading the swarm's state."""
    clock = [0.0]
    schedule: Schedule

    class SharedMachine:
        def read(self) -> Reading:  # what a busy program reads beside us, training or not
            paused = schedule._paused_for is not None
            return Reading(other_cpu=0.4 if paused else 0.9, on_battery=None, now=NOON)

    schedule = Schedule(
        ScheduleConfig(max_other_cpu=0.6, check_every_s=1, resume_after_s=10),
        SharedMachine(),
        lambda: clock[0],
    )
    resumes, waits, was_paused = 0, [], False
    for t in range(2000):
        clock[0] = float(t)
        paused = schedule.check() is not None
        if paused and not was_paused:
            waits.append(schedule.wait_s)
        resumes += was_paused and not paused
        was_paused = paused
    assert waits[:6] == [10, 20, 40, 80, 160, 160], "doubling, up to 16 x resume_after_s"
    assert resumes <= 2000 // 160 + 5, f"{resumes} resumes in 2000 s: it kept flapping"

    # What counts is the time it trained: a resumed peer first catches up with the swarm (it may load the
    # swarm's state), and it asks the schedule again only once it trains.
    resumed = Schedule(
        ScheduleConfig(max_other_cpu=0.6, check_every_s=1, resume_after_s=10),
        FakeMachine(0.9),
        lambda: clock[0],
    )
    clock[0] = 0.0
    assert resumed.check() is not None and resumed.wait_s == 10
    resumed.machine.other_cpu = 0.1
    for t in range(1, 30):
        clock[0] = float(t)
        if resumed.check() is None:
            break
    assert clock[0] == 11.0, "resumed once free for 10 s"
    clock[0] += 100.0  # catching up: no check meanwhile
    resumed.machine.other_cpu = 0.9
    assert resumed.check() is not None and resumed.wait_s == 20, "paused at its first step: a flap"

    # Once the load is gone and the peer trained longer than it last waited, a pause waits the base again.
    assert resume_wait_s(10, 160, 161) == 10 and resume_wait_s(10, 160, 30) == 160
    assert resume_wait_s(10, None, None) == 10 and resume_wait_s(10, 10, 2) == 20
    assert resume_wait_s(0, 0, 0) == 0, "resume_after_s 0: no hysteresis asked, none added"


def test_the_machine_reads_other_processes_cpu_without_our_own():
    import collections
    import types

    import psutil

    Times = collections.namedtuple("Times", "user system idle iowait guest", defaults=[0.0])

    class Proc:
        def __init__(self, pid, cpu_s, kids=()):
            self.pid, self.cpu_s, self.kids = pid, cpu_s, list(kids)

        def cpu_times(self):
            if self.cpu_s is None:
                raise psutil.NoSuchProcess(self.pid)
            return types.SimpleNamespace(user=self.cpu_s, system=0.0)

        def children(self, recursive):
            return self.kids

    child = Proc(2, 0.0)  # our averager, say: its CPU is ours too
    me = Proc(1, 0.0, [child])
    machine_s = [Times(0.0, 0.0, 0.0, 0.0)]
    fake = types.SimpleNamespace(
        cpu_times=lambda: machine_s[0],
        sensors_battery=lambda: types.SimpleNamespace(power_plugged=False),
        NoSuchProcess=psutil.NoSuchProcess,
        AccessDenied=psutil.AccessDenied,
    )
    machine = Machine()
    machine._psutil, machine._me = fake, me
    machine._last_total, machine._last_own = machine._busy_and_total(), machine._own_cpu_s()
    # One second on 2 cores: 1.5 s busy, of which 0.6 s ours and 0.4 s our child's, 0.5 s idle. Others used 0.5
    # s of the 1.0 s we left free: 0.5 (counting our own CPU as theirs would read 0.75).
    machine_s[0] = Times(user=1.2, system=0.3, idle=0.4, iowait=0.1)
    me.cpu_s, child.cpu_s = 0.6, 0.4
    reading = machine.read()
    assert reading.other_cpu == pytest.approx(0.5) and reading.on_battery is True
    # The next second: the child exited (its time is not ours to subtract), nobody else ran, we took 1 s of CPU.
    machine_s[0] = Times(user=2.2, system=0.3, idle=1.4, iowait=0.1)
    me.cpu_s, child.cpu_s = 1.6, None
    assert machine.read().other_cpu == pytest.approx(0.0)
    # Then a VM ran 0.5 s: Linux counts guest time in user as well, once is enough (0.5 of the 1.0 s left free).
    machine_s[0] = Times(user=3.7, system=0.3, idle=1.9, iowait=0.1, guest=0.5)
    me.cpu_s = 2.6
    assert machine.read().other_cpu == pytest.approx(0.5)


def test_a_paused_peer_costs_the_others_no_wait_and_rejoins_on_its_own(tmp_path, monkeypatch):
    swarm = MemorySwarm()
    paused: list[int] = []  # the round c paused in, once it has
    peers: dict[str, PeerThread] = {}
    game = threading.Event()  # the volunteer's game has started

    def hold_the_others_until_c_is_back(thread: str, _steps: int) -> None:
        # In round 4, a and b wait for the game to start (a starved main thread must not let the run end first);
        # two rounds past c's pause, they take no step until c has caught up: otherwise they may finish the run
        # before c's schedule notices that the machine is free (they did, with rounds overlapped).
        name = thread.removeprefix("trainer-")
        if name == "c" or name not in peers:
            return
        if peers[name].trainer.round >= 4 and not game.wait(60):
            raise AssertionError("the game never started")
        if not paused or peers[name].trainer.round < paused[0] + 2:
            return
        deadline = time.monotonic() + 60
        while not peers["c"].trainer.loads:
            if time.monotonic() > deadline:
                raise AssertionError("c did not come back within 60 s of the game's end")
            time.sleep(0.01)

    slowed_steps(monkeypatch, {}, after=hold_the_others_until_c_is_back)
    machine = FakeMachine()
    sections = {
        "outer": {"num_rounds": 8},
        "swarm": {"min_peers": 3},
        # Were they to wait for the paused peer, they would wait for 10 minutes: no deadline here comes close.
        "averaging": {"target_group_size": 3, "barrier_timeout_s": 600.0},
    }
    configs = {name: fast_config(tmp_path, name, **sections) for name in ("a", "b", "c")}
    configs["c"] = fast_config(
        tmp_path,
        "c",
        **sections,
        schedule={"max_other_cpu": 0.5, "check_every_s": 0.02, "resume_after_s": 0.2},
    )

    def trainer(cfg, **kwargs):
        return Trainer(cfg, machine=machine if cfg is configs["c"] else None, **kwargs)

    peers.update({name: PeerThread(swarm, name, cfg, trainer_cls=trainer) for name, cfg in configs.items()})
    peers["c"].wait_until(lambda t: t.round >= 2)
    machine.other_cpu = 0.9  # the volunteer starts a game
    game.set()
    peers["c"].wait_until(lambda t: bool(t.pauses))
    paused_in = peers["c"].trainer.pauses[0][0]
    paused.append(paused_in)
    # The others go on without it: two rounds while it is paused (its machine stays busy until we say).
    peers["a"].wait_until(lambda t: t.round >= paused_in + 2)
    assert swarm.read()[peers["c"].trainer.peer_id].state == PeerState.PAUSED
    machine.other_cpu = 0.0  # the game is over
    finish(peers)
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c"])
    c = peers["c"].trainer
    # It came back behind and caught up (more than once, when the swarm moved on again while it loaded).
    assert c.loads and {why for why, _ in c.loads} == {"catch_up"}, c.loads
    assert paused_in not in c.rounds_applied and c.rounds_applied[-1] == 7
    assert all(peers[n].trainer.rounds_applied == list(range(8)) for n in ("a", "b"))


def test_a_pause_while_training_on_past_h_averages_the_round_first(tmp_path, monkeypatch):
    """inner.max_steps_while_waiting: past its H steps a peer is averaging in the others' eyes; a pause
    then must not drop its round (the others' group expects it), only follow it."""
    swarm, machine = MemorySwarm(), FakeMachine()
    sections = {
        "swarm": {"min_peers": 2},
        "averaging": {"target_group_size": 2},
        "inner": {"max_steps_while_waiting": 1000},  # trains on for as long as the slow peer takes
    }
    configs = {
        "slow": fast_config(tmp_path, "slow", **sections),
        "fast": fast_config(
            tmp_path,
            "fast",
            **sections,
            schedule={"max_other_cpu": 0.5, "check_every_s": 0.001, "resume_after_s": 0.2},
        ),
    }
    H = configs["fast"].inner.num_inner_steps

    def game(thread: str, steps: int) -> None:  # the volunteer starts a game while its peer trains on past H
        if thread == "trainer-fast" and steps == H + 2:
            machine.other_cpu = 0.9

    # The fast peer is done with round 0 long before the slow one.
    slowed_steps(monkeypatch, {"trainer-slow": 0.1}, after=game)

    def trainer(cfg, **kwargs):
        return Trainer(cfg, machine=machine if cfg is configs["fast"] else None, **kwargs)

    peers = {name: PeerThread(swarm, name, cfg, trainer_cls=trainer) for name, cfg in configs.items()}
    peers["fast"].wait_until(lambda t: bool(t.pauses))
    machine.other_cpu = 0.0
    finish(peers)
    assert_swarm_contract(tmp_path, peers, ["fast", "slow"])
    fast, slow = peers["fast"].trainer, peers["slow"].trainer
    assert fast.pauses[0][0] == 1, f"paused after averaging round 0, not in it: {fast.pauses}"
    assert 0 in fast.rounds_applied and 0 in slow.rounds_applied
    assert swarm.weights[("fast", 0)] == swarm.weights[("slow", 0)], "round 0 averaged the two of them"


def test_a_peer_without_a_schedule_reads_no_machine(tmp_path):
    cfg = fast_config(tmp_path, "a")
    assert Trainer(cfg, stop=threading.Event()).schedule is None


def test_memory_over_the_cap_is_named_with_what_it_takes():
    from p2ptrain.schedule import memory_problem, own_memory_bytes

    used = own_memory_bytes()
    assert used > 0
    assert memory_problem(None, used, "now") is None
    assert memory_problem(used / 2**30 + 1, used, "now") is None
    problem = memory_problem(0.01, 3 * 2**30, "after one inner step")
    assert problem is not None and problem.startswith("device.max_memory_gb 0.01: ")
    assert "3.00 GB after one inner step" in problem


def test_a_peer_over_its_memory_cap_refuses_to_start_or_stops_cleanly(tmp_path, monkeypatch):
    from p2ptrain import trainer
    from p2ptrain.trainer import Outcome

    swarm = MemorySwarm()
    capped = fast_config(tmp_path, "a", device={"max_memory_gb": 0.01})  # far below what this process holds
    refused = PeerThread(swarm, "a", capped).join()
    assert isinstance(refused, ConfigError) and "device.max_memory_gb 0.01" in str(refused)

    # Under the cap at start; over it after a round (as a leak would be): it stops, saves, and says why.
    held = [1 * 2**30]
    monkeypatch.setattr(trainer, "own_memory_bytes", lambda: held[0])
    cfg = fast_config(tmp_path, "b", device={"max_memory_gb": 2.0})
    peer = PeerThread(swarm, "b", cfg)
    peer.wait_until(lambda t: t.round >= 1)
    held[0] = 3 * 2**30
    result = peer.join()
    assert result.outcome == Outcome.INTERRUPTED and "device.max_memory_gb 2: " in result.reason, result
    assert (tmp_path / "b" / "interrupted.safetensors").exists()


def test_max_other_cpu_of_one_is_refused_it_could_never_be_passed():
    with pytest.raises(ConfigError, match=r"schedule\.max_other_cpu"):
        load_config(None, {"schedule": {"max_other_cpu": 1.0}})
