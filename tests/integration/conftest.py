"""Helpers for multi-peer tests: real processes on 127.0.0.1, and a check that none outlive the test."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from p2ptrain import checkpoint
from p2ptrain.evaluation import Evaluator
from p2ptrain.localswarm import LOOPBACK, PeerProcess, stop_all
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"
__all__ = ["LOOPBACK", "TINY", "PeerProcess"]


def processes_named(name: str) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def children_of(pid: int) -> set[int]:
    """All descendants of ``pid`` (children, grandchildren, ...) alive now."""
    found, frontier = set(), {pid}
    while frontier:
        parent = frontier.pop()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text().split(")")[-1].split()
                except OSError:
                    continue
                if int(stat[1]) == parent and int(entry) not in found:
                    found.add(int(entry))
                    frontier.add(int(entry))
    return found


def wait_until_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = {pid for pid in pids if Path(f"/proc/{pid}").exists() and _not_zombie(pid)}
        if not alive:
            return set()
        time.sleep(0.2)
    return alive


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(autouse=True)
def no_leftover_p2pd():
    """Every integration test must leave no p2pd behind (a user's machine would keep them)."""
    before = processes_named("p2pd")
    yield
    leftover = wait_until_gone(processes_named("p2pd") - before, timeout_s=20)
    for pid in leftover:  # reap them so that one failure does not cascade into the next tests
        os.kill(pid, signal.SIGKILL)
    assert not leftover, f"p2pd processes left running: {sorted(leftover)}"


@pytest.fixture
def spawn(tmp_path):
    """Start ``p2ptrain ARGS...`` processes; all of them are stopped at teardown."""
    started: list[PeerProcess] = []

    def _spawn(*args: str, name: str | None = None, env: dict[str, str] | None = None) -> PeerProcess:
        p = PeerProcess(list(args), tmp_path / f"{name or f'proc{len(started)}'}.log", env=env)
        started.append(p)
        return p

    yield _spawn
    stop_all(started)


def join_args(tmp_path: Path, name: str, run_id: str, *extra: str) -> list[str]:
    return [
        "join",
        "--config",
        str(TINY),
        "--host-maddrs",
        LOOPBACK,
        "--log-format",
        "json",
        "--set",
        f"run.run_id={run_id}",
        "--set",
        f"checkpoint.dir={tmp_path / name}",
        *extra,
    ]


def val_losses(loaded: checkpoint.LoadedModel) -> tuple[float, float]:
    """Validation loss of the run's initial model and of ``loaded``'s params."""
    evaluator = Evaluator()
    return evaluator.initial(loaded.config)["val_loss"], evaluator.loaded(loaded)["val_loss"]
