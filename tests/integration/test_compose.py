"""deploy/docker-compose.yml's swarm, run here as processes: its bootstrap node and peers, with the commands and
environment the compose file and the image give them, train together.

Only what a container supplies is replaced: its interfaces (loopback, a free port), its volumes (a folder per
service, one shared for /bootstrap) and the image's paths (/opt/p2ptrain is this checkout). No docker needed.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

DEPLOY = ROOT / "deploy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_env() -> dict[str, str]:
    """The image's P2PTRAIN_ variables (its ENV lines)."""
    return dict(re.findall(r"(P2PTRAIN_\w+)=(\S+)", (DEPLOY / "Dockerfile").read_text()))


def as_process(service: dict, volumes: dict[str, Path]) -> tuple[list[str], dict[str, str]]:
    """A compose service's command and environment, with its container's paths and interfaces replaced."""

    def local(text: str) -> str:
        for inside, outside in volumes.items():
            text = text.replace(inside, str(outside))
        text = text.replace("/opt/p2ptrain", str(ROOT))
        text = re.sub(r"^--host-maddrs=/ip4/0\.0\.0\.0/tcp/\d+$", "--host-maddrs=/ip4/127.0.0.1/tcp/0", text)
        return re.sub(r"^--metrics-port=\d+$", f"--metrics-port={free_port()}", text)

    env = {**image_env(), **service.get("environment", {})}
    env = {k: re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", local(v)) for k, v in env.items()}  # unset: the default
    # The container's own interfaces are, here, this machine's loopback.
    env["P2PTRAIN_METRICS__HOST"] = "127.0.0.1"
    return [local(arg) for arg in service["command"]], env


def test_the_compose_swarm_trains(tmp_path, spawn):
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    bootstrap = tmp_path / "bootstrap"
    bootstrap.mkdir()

    def start(name: str):
        data = tmp_path / name
        data.mkdir()
        args, env = as_process(services[name], {"/bootstrap": bootstrap, "/data": data})
        return spawn(*args, name=name, env=env)

    start("dht")
    maddrs = bootstrap / "dht.maddrs"
    deadline = time.monotonic() + 90
    while not (maddrs.exists() and maddrs.stat().st_size) and time.monotonic() < deadline:  # its healthcheck
        time.sleep(0.2)
    assert maddrs.exists(), "the bootstrap node wrote no dht.maddrs"

    peers = [start("peer1"), start("peer2")]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if all(any(s["group_size"] == 2 for s in p.outer_steps()) for p in peers):
            break
        exited = [p for p in peers if p.proc.poll() is not None]
        assert not exited, f"a compose peer exited: {exited[0].stdout()}\n{exited[0].tail()}"
        time.sleep(0.5)
    else:
        raise AssertionError(f"no outer step of both peers together:\n{peers[0].tail()}\n{peers[1].tail()}")
    for name in ("peer1", "peer2"):  # what must survive a restart is in its /data volume
        assert (tmp_path / name / "identity.key").exists()
