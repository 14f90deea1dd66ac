"""Helpers for multi-peer tests: real processes on 127.0.0.1, and a check that none outlive the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from p2ptrain import checkpoint
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.models import build_model
from p2ptrain.trainer import evaluate
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


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


class PeerProcess:
    """A `p2ptrain` subprocess whose stdout we can search; always stopped at teardown."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._out_path = log_path.with_suffix(".out")
        self._out = open(self._out_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "p2ptrain", *args],
            stdout=self._out,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.descendants: set[int] = set()

    def stdout(self) -> str:
        return self._out_path.read_text()

    def wait_for_maddr(self, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for word in self.stdout().split():
                if word.startswith("/ip4/127.0.0.1/"):
                    return word
            assert self.proc.poll() is None, (
                f"exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
            )
            time.sleep(0.1)
        raise AssertionError(f"no multiaddr printed: {self.log_path.read_text()[-2000:]}")

    def events(self) -> list[dict]:
        """The JSON log lines written so far."""
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def outer_steps(self) -> list[dict]:
        return [e for e in self.events() if e.get("event") == "outer step"]

    def remember_descendants(self) -> set[int]:
        """Record the DHT child, averager child and p2pd now, to check later that none outlive us."""
        self.descendants |= children_of(self.proc.pid)
        return self.descendants

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running after {timeout_s}s: {self.log_path.read_text()[-3000:]}"
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._out.close()


@pytest.fixture
def spawn(tmp_path):
    started: list[PeerProcess] = []

    def _spawn(*args: str, name: str | None = None, env: dict[str, str] | None = None) -> PeerProcess:
        p = PeerProcess(list(args), tmp_path / f"{name or f'proc{len(started)}'}.log", env=env)
        started.append(p)
        return p

    yield _spawn
    for p in started:
        p.stop()


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
    cfg = loaded.config
    corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    initial = build_model(cfg.model.name, cfg.model.context_length, seed=cfg.run.seed)
    final = build_model(cfg.model.name, cfg.model.context_length)
    checkpoint.load_into(final, loaded)
    cpu = torch.device("cpu")
    return evaluate(initial, corpus, cfg, cpu)["val_loss"], evaluate(final, corpus, cfg, cpu)["val_loss"]
