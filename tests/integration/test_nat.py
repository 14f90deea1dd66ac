"""A volunteer behind a home router's NAT (no connection can be opened to it) in client mode, with two peers
that take calls, each in a network namespace of its own: it trains in every round's group to the end."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from bench.netns import NetError, ShapedNet, available
from p2ptrain import checkpoint
from p2ptrain.localswarm import PeerProcess, stop_all
from tests.integration.conftest import TINY

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(available() is not None, reason=f"no network namespaces here: {available()}"),
]

LISTEN = "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 4555)); s.listen(); time.sleep(30)"
DIAL = """import socket, sys, time
deadline = time.monotonic() + 10
while True:  # the listener may not be up yet: refused means try again, a silent timeout means no way in
    try:
        socket.create_connection((sys.argv[1], 4555), timeout=2).close(); print("open"); break
    except ConnectionRefusedError:
        if time.monotonic() > deadline: print("refused"); break
        time.sleep(0.1)
    except OSError as e:
        print("closed", type(e).__name__); break
"""


def dial(net: ShapedNet, source: int, target: int) -> str:
    """Whether a connection from peer ``source`` to a listener of peer ``target`` opens."""
    listener = subprocess.Popen([*net.prefix(target), sys.executable, "-c", LISTEN])
    try:
        out = subprocess.run(
            [*net.prefix(source), sys.executable, "-c", DIAL, net.address(target)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout.strip()
    finally:
        listener.kill()
        listener.wait()


def test_a_client_behind_a_nat_trains_in_every_rounds_group(tmp_path):
    """The NAT is checked first (a dial to the client goes unanswered, its own dials open). Then a client
    takes no calls and nobody can open a connection to it: it sends its parts to the reducers and gets the
    average back on its own streams, and the others' pushes reach it over the connections it opened. Every
    peer averages every round in a group of three, and all end with identical params."""
    run_id = f"t{uuid.uuid4().hex[:8]}"
    rounds = 4
    with ShapedNet(3, None) as net:
        try:
            net.behind_nat(2)
        except NetError as e:  # a kernel without htb or u32: say so rather than fail
            pytest.skip(f"cannot emulate a NAT here: {e}")
        assert dial(net, 2, 0) == "open"
        assert dial(net, 0, 2).startswith("closed")  # silently: as a NAT does, not a refusal

        def join(i: int, *extra: str) -> PeerProcess:
            args = ["join", "--config", str(TINY), "--host-maddrs", f"/ip4/{net.address(i)}/tcp/0"]
            args += ["--log-format", "json", "--rounds", str(rounds), "--set", f"run.run_id={run_id}"]
            args += ["--set", "swarm.min_peers=3", "--set", f"checkpoint.dir={tmp_path / str(i)}", *extra]
            return PeerProcess(args, tmp_path / f"{i}.log", index=i, prefix=net.prefix(i))

        peers = [join(0)]
        try:
            first = peers[0].wait_for_maddr(prefix=f"/ip4/{net.address(0)}/")
            peers.append(join(1, "--initial-peers", first))
            peers.append(join(2, "--initial-peers", first, "--client-mode"))
            deadline = time.monotonic() + 300
            for i, p in enumerate(peers):
                assert p.wait(max(1.0, deadline - time.monotonic())) == 0, f"peer {i}: {p.tail()}"
        finally:
            stop_all(peers)
    finals = [checkpoint.load(tmp_path / str(i) / "final.safetensors") for i in range(3)]
    assert len({f.params_sha256() for f in finals}) == 1, "peers disagree on the final params"
    for i, p in enumerate(peers):
        steps = [(s["round"], s["group_size"]) for s in p.outer_steps()]
        assert steps == [(r, 3) for r in range(rounds)], (i, steps)
