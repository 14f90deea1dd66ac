import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def p2ptrain_cmd() -> list[str]:
    return [sys.executable, "-m", "p2ptrain"]


def _p2pd_processes() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "p2pd":
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


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
    before = _p2pd_processes()
    yield
    assert not (_p2pd_processes() - before), "a unit test started p2pd; move it to tests/integration/"
