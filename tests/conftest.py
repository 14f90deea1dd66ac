import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def p2ptrain_cmd() -> list[str]:
    return [sys.executable, "-m", "p2ptrain"]


def _our_p2pd_processes() -> set[int]:
    """p2pd processes descending from this test process (not another swarm's on the same machine)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            pid = int(entry.name)
            names[pid] = stat[stat.index("(") + 1 : stat.rindex(")")]
            parents[pid] = int(stat[stat.rindex(")") + 2 :].split()[1])
    me, ours = os.getpid(), set()
    for pid, name in names.items():
        if name == "p2pd":
            ancestor = parents.get(pid, 0)
            while ancestor > 1 and ancestor != me:
                ancestor = parents.get(ancestor, 0)
            if ancestor == me:
                ours.add(pid)
    return ours


@pytest.fixture(autouse=True)
def _unit_tests_use_no_network(request, monkeypatch):
    """A unit test (not marked ``integration``) opens no socket and starts no p2pd: `make test-unit` is offline
    and fast. Tests that need the network belong in tests/integration/."""
    if request.node.get_closest_marker("integration"):
        yield
        return

    def refuse(*_args, **_kwargs):
        raise AssertionError("a unit test tried to use the network; move it to tests/integration/")

    for method in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, method, refuse)
    before = _our_p2pd_processes()
    yield
    assert not (_our_p2pd_processes() - before), "a unit test started p2pd; move it to tests/integration/"
