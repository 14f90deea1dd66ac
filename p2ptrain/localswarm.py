"""Real ``p2ptrain`` processes on this machine: one wrapper for the demo, the benchmarks and the tests.

A :class:`PeerProcess` starts ``python -m p2ptrain ARGS...``, follows its stdout (the multiaddrs it
prints, the final model's path) and its stderr (JSON log lines, kept as events and written to a log
file) from two threads, and stops it: SIGTERM, then SIGKILL after a grace period. Peers shut hivemind's
children down on SIGTERM; on SIGKILL their watchdogs do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from p2ptrain.procs import PARENT_PID_ENV

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class PeerProcessError(RuntimeError):
    """A peer process exited, or did not do what was awaited in time. The message names its log."""


_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0}
    if sys.version_info >= (3, 11)
    else {"preexec_fn": os.setpgrp}  # 3.10: no process_group
)


class PeerProcess:
    """One ``p2ptrain`` subprocess whose output is followed; always :meth:`stop` it (demo and tests do).

    Args:
        args: arguments after ``python -m p2ptrain``.
        log_path: where its stderr goes, line by line.
        env: extra environment variables.
        on_event: called from the reader thread with (this, event) for each JSON log line.
        module: what ``python -m`` runs (the benchmarks' hostile peers are not ``p2ptrain``).
        prefix: a command to run it under (the shaped-link benchmark's ``ip netns exec NAME``).
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        on_event: Callable[[PeerProcess, dict[str, Any]], None] | None = None,
        index: int = 0,
        module: str = "p2ptrain",
        prefix: list[str] | None = None,
    ):
        self.args, self.log_path, self.index = list(args), Path(log_path), index
        self._terminated = False
        self.stdout_lines: list[str] = []
        self._events: list[dict[str, Any]] = []
        self._on_event = on_event
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        command = list(self.args)
        if module == "p2ptrain" and command[:1] in (["join"], ["dht"]):
            command.insert(1, "--exit-with-parent")  # a demo or test that is killed takes it along
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", module, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid()), **(env or {})},
            # Its own process group: a Ctrl-C at the terminal reaches only us, and we stop it once, cleanly (it
            # would take our SIGTERM after the terminal's SIGINT as a second signal and exit without saving).
            # Not its own session: the kernel shares CPU between sessions (autogroups), and a peer's trainer
            # would then compete with its own averager and p2pd for one session's share (suspected in two
            # under-load failures where a follower missed its leader's group).
            **_OWN_PROCESS_GROUP,
        )
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line.rstrip("\n"))

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._log.write(line)
            self._log.flush()
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                self._events.append(event)
                if self._on_event is not None:
                    self._on_event(self, event)

    # ------------------------------------------------------------------------------------ reading

    def stdout(self) -> str:
        return "\n".join(self.stdout_lines)

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines so far."""
        return list(self._events)

    def outer_steps(self) -> list[dict[str, Any]]:
        return [e for e in self._events if e.get("event") == "outer step"]

    def peer_id(self) -> str | None:
        """Its peer id, once it has logged that it started."""
        return next((e["peer_id"] for e in self._events if e.get("event") == "peer started"), None)

    def maddr(self, prefix: str = "/ip4/127.0.0.1/") -> str | None:
        """The first multiaddr it printed that starts with ``prefix``."""
        for line in self.stdout_lines:
            for word in line.split():
                if word.startswith(prefix):
                    return word
        return None

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    # ----------------------------------------------------------------------------------- waiting

    def wait_for_maddr(self, timeout_s: float = 90, prefix: str = "/ip4/127.0.0.1/") -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            maddr = self.maddr(prefix)
            if maddr:
                return maddr
            if self.proc.poll() is not None:
                raise PeerProcessError(
                    f"p2ptrain {self.args[0]} exited with code {self.proc.returncode} before printing its "
                    f"address; see {self.log_path}"
                )
            time.sleep(0.1)
        raise PeerProcessError(f"no address printed within {timeout_s:.0f}s; see {self.log_path}")

    def wait(self, timeout_s: float) -> int:
        """Its exit code, once it has exited (PeerProcessError if it still runs after ``timeout_s``)."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise PeerProcessError(f"still running after {timeout_s:.0f}s; see {self.log_path}") from None
        for t in self._threads:
            t.join(timeout=5)  # the rest of its output
        return code

    def terminate(self) -> None:
        """SIGTERM, once: a peer takes a second one as "exit at once, without saving"."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM (unless :meth:`terminate` sent it), then SIGKILL after ``grace_s``. Safe to call twice."""
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for t in self._threads:
            t.join(timeout=5)
        self._log.close()


def stop_all(procs: Sequence[PeerProcess], grace_s: float = 20.0) -> None:
    """Stop them together: SIGTERM to each, then one ``grace_s`` for all of them (not one after another)."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.stop(grace_s=max(0.0, deadline - time.monotonic()))


def closed_swarm_join(workdir: Path, config: Path, sets: list[str]) -> tuple[list[str], Path]:
    """A fresh ``workdir`` with a new swarm key, and the ``p2ptrain join`` arguments of a peer of that closed
    swarm on 127.0.0.1 (JSON logs, ``--set`` each of ``sets``). Returns (arguments, key file)."""
    from p2ptrain.membership import generate_swarm_key

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    key = workdir / "swarm.key"
    generate_swarm_key(key)
    args = ["join", "--config", str(config), "--host-maddrs", LOOPBACK, "--log-format", "json"]
    args += ["--key-file", str(key)]
    for item in sets:
        args += ["--set", item]
    return args, key


def run_swarm(
    base: list[str],
    workdir: Path,
    count: int,
    *,
    hostile: dict[int, tuple[str, list[str]]] | None = None,
    extra: dict[int, list[str]] | None = None,
    timeout_s: float = 1800,
    started: Callable[[list[PeerProcess]], None] | None = None,
    prefix: Callable[[int], list[str]] | None = None,
    maddr_prefix: str = "/ip4/127.0.0.1/",
) -> tuple[list[PeerProcess], list[int]]:
    """Run ``count`` peers of ``base`` join arguments to their end, each with its own checkpoint dir and log
    under ``workdir``; the first one's address is the others' initial peer. ``hostile``: peer index ->
    (module, arguments before ``base``) for a peer that is not plain ``p2ptrain``; ``extra``: index -> more
    arguments. ``started``: called with the list of processes once the first has started (the others are
    appended to it as they start). ``prefix``: index -> the command a peer runs under; ``maddr_prefix``: the
    first peer's address that the others join through. Returns the processes (stopped) and their exit codes."""
    hostile, extra = hostile or {}, extra or {}
    procs: list[PeerProcess] = []
    try:
        first = None
        for i in range(count):
            args = base + ["--set", f"checkpoint.dir={workdir / f'peer{i}'}", *extra.get(i, [])]
            args += ["--initial-peers", first] if first else []
            module, before = hostile.get(i, ("p2ptrain", []))
            procs.append(
                PeerProcess(
                    [*before, *args],
                    workdir / f"peer{i}.log",
                    index=i,
                    module=module,
                    prefix=prefix(i) if prefix is not None else None,
                )
            )
            if first is None:
                if started is not None:
                    started(procs)
                first = procs[0].wait_for_maddr(timeout_s=90, prefix=maddr_prefix)
        codes = [p.wait(timeout_s=timeout_s) for p in procs]
    finally:
        stop_all(procs)
    return procs, codes
