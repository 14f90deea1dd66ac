"""Signals: a peer stops within seconds, keeps its work, and takes its DHT child and p2pd with it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid

import pytest

from p2ptrain.config import SwarmConfig
from p2ptrain.swarm import create_dht, stop_dht
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
        assert peer.wait(90) == 0, peer.tail()  # a hang, not a slow machine: saving and stopping take seconds
        assert not wait_until_gone(descendants, timeout_s=10), "DHT child, averager or p2pd outlived the peer"
        errors = [e for e in peer.events() if e.get("level") == "error"]
        assert not errors, errors
        assert (tmp_path / sig.name / "interrupted.safetensors").is_file(), "a stopped peer keeps its work"
        assert "Stopped; this peer's state is in" in peer.stdout()


PARENT = """
import sys, time
from pathlib import Path
from p2ptrain.localswarm import PeerProcess

peer = PeerProcess(sys.argv[2:], Path(sys.argv[1]))
print(peer.proc.pid, flush=True)
while not peer.outer_steps():
    time.sleep(0.1)
print("trained", flush=True)
time.sleep(3600)
"""


def test_a_peer_started_by_a_demo_or_test_that_is_killed_stops_with_it(tmp_path):
    """SIGKILL of whatever started the peers (the demo, a test run, a cancelled CI job) used to leave them
    training to their last round; a peer started through PeerProcess now stops cleanly, as on SIGTERM."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    args = join_args(tmp_path, "peer", f"t{uuid.uuid4().hex[:8]}", "--set", "outer.num_rounds=1000")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "peer.log"), *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    peer_pid = None
    try:
        assert parent.stdout is not None
        peer_pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "trained", (tmp_path / "peer.log").read_text()[-2000:]
        descendants = children_of(peer_pid) | {peer_pid}
        assert descendants & processes_named("p2pd"), "the peer should own a p2pd"
        parent.kill()
        parent.wait()
        assert not wait_until_gone(descendants, timeout_s=60), "the peer or its children outlived the demo"
        assert (tmp_path / "peer" / "interrupted.safetensors").is_file(), (
            "it stopped cleanly, keeping its work"
        )
    finally:
        if parent.poll() is None:
            parent.kill()
        if peer_pid is not None:  # a failed test leaves no peer behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(peer_pid, signal.SIGKILL)


STARTER = """
import os, subprocess, sys
from pathlib import Path
from p2ptrain.localswarm import PeerProcess

peer = PeerProcess(sys.argv[2:], Path(sys.argv[1]))
# Something else keeps the peer's output pipes open (as a pipeline's next command would), so that only its
# watch of its starter can stop it.
pipes = (peer.proc.stdout.fileno(), peer.proc.stderr.fileno())
holder = subprocess.Popen(["sleep", "600"], pass_fds=pipes, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(peer.proc.pid, holder.pid, flush=True)
os._exit(0)  # gone long before the peer has imported torch
"""


def test_a_peer_whose_starter_dies_while_it_starts_up_stops_too(tmp_path):
    """A peer learnt who started it from its parent process id once it had started up (seconds of imports):
    one whose starter died before then had been handed to init already, watched init, and trained on with
    nobody to stop it (found in the code). The starter now names itself."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    args = join_args(tmp_path, "peer", f"t{uuid.uuid4().hex[:8]}", "--set", "outer.num_rounds=1000")
    out = subprocess.run(
        [sys.executable, "-c", STARTER, str(tmp_path / "peer.log"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    peer_pid, holder_pid = map(int, out.stdout.split())
    try:
        assert not wait_until_gone({peer_pid}, timeout_s=120), "the peer outlived its starter"
    finally:  # a failed test leaves nothing behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(peer_pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder_pid, signal.SIGKILL)


# `p2ptrain` as a terminal's foreground job runs it: Ctrl-C raises KeyboardInterrupt. A test run started in the
# background by a shell without job control (`make test &` in a script) ignores SIGINT, and a Python started
# ignoring it keeps ignoring it: the demo would train on through its Ctrl-C.
AT_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'p2ptrain'; runpy.run_module('p2ptrain', run_name='__main__', alter_sys=True)"
)


def test_ctrl_c_at_the_demo_stops_each_peer_once_and_cleanly(tmp_path):
    """Ctrl-C signals the terminal's whole process group. The peers shared the demo's, so each took the
    terminal's SIGINT and then the demo's SIGTERM as a second signal: exit 143, nothing saved. Each peer
    now has a process group of its own, and the demo stops it once."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    demo = subprocess.Popen(
        [sys.executable, "-c", AT_A_TERMINAL, "demo", "--peers", "2", "--rounds", "1000"]
        + ["--config", str(ROOT / "configs" / "tiny.yaml"), "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # a terminal of its own: the group a Ctrl-C reaches
    )
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # its first round line: both peers train
            if line.startswith("round "):
                break
        else:
            raise AssertionError(
                f"the demo ended before a round: {demo.stderr.read() if demo.stderr else ''}"
            )
        os.killpg(demo.pid, signal.SIGINT)  # what Ctrl-C at its terminal does
        _, err = demo.communicate(timeout=120)
        assert "interrupted: stopping the peers" in err
        for i in range(2):
            log = (tmp_path / f"peer{i}.log").read_text()
            assert "second signal" not in log, log[-2000:]
            assert (tmp_path / f"peer{i}" / "interrupted.safetensors").is_file(), log[-2000:]
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_dht_child_killed_hard_takes_its_p2pd_with_it(sig):
    """hivemind's DHT.shutdown SIGTERMs a child that has not shut down cleanly within its grace period (no
    clean shutdown of p2pd then), and the kernel's OOM killer SIGKILLs: p2pd must not outlive it either."""
    dht = create_dht(SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    try:
        daemons = children_of(dht.pid) & processes_named("p2pd")
        assert daemons, "the DHT child started no p2pd"
        os.kill(dht.pid, sig)
        assert not wait_until_gone(daemons, timeout_s=30), "p2pd outlived its DHT child"
    finally:
        stop_dht(dht)
