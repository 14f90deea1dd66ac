"""A progress bar for the inner steps of a round, on a terminal only (never in logs, pipes or services)."""

from __future__ import annotations

import sys
import time
from typing import Any


class InnerProgress:
    """``with InnerProgress(enabled, total=H, round=r) as bar: ... bar.update(loss_fn, samples)``; ``total`` None:
    a round by time, whose steps are not known in advance.

    Disabled, it does nothing at all. Enabled, it redraws at most every ``refresh_s`` and only then asks
    for the loss (a device sync), so it costs nothing per step.
    """

    def __init__(self, enabled: bool, *, total: int | None, round: int, refresh_s: float = 0.5):
        self.enabled, self.total, self.round, self.refresh_s = enabled, total, round, refresh_s
        self._progress: Any = None
        self._task: Any = None
        self._last = -float("inf")  # the first update always draws (monotonic() may be small after a boot)
        self._started = time.monotonic()

    def __enter__(self) -> InnerProgress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("round {task.fields[round]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[rate]} samples/s"),
                TimeRemainingColumn(),
                console=Console(file=sys.stderr),
                transient=True,
                redirect_stderr=True,  # log lines print above the bar (logs.py writes to the current sys.stderr)
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "inner", total=self.total, round=self.round, loss="…", rate="…"
            )
        return self

    def update(self, steps: int, samples: int, loss: Any) -> None:
        """``loss``: a callable returning the running mean loss, called only when the bar redraws."""
        if self._progress is None:
            return
        now = time.monotonic()
        if now - self._last < self.refresh_s and (self.total is None or steps < self.total):
            return
        self._last = now
        rate = samples / max(now - self._started, 1e-9)
        self._progress.update(self._task, completed=steps, loss=f"{loss():.4f}", rate=f"{rate:.1f}")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def terminal_progress_enabled(log_format: str) -> bool:
    """A bar only for a person watching: stderr is a terminal and logs are the readable kind."""
    return sys.stderr.isatty() and log_format in ("auto", "console")


class Waiting:
    """What a peer waits for (peers at the barrier, a group, the swarm's state), shown while it lasts.

    On a terminal (with readable logs), a spinner line that says what and for how long; elsewhere, a log line
    once the wait has lasted ``first_s``, then every ``every_s``: a service's log shows a peer that waits,
    without a line per poll.
    """

    def __init__(self, enabled: bool, log: Any, *, first_s: float = 10.0, every_s: float = 60.0):
        self.enabled, self.log, self.first_s, self.every_s = enabled, log, first_s, every_s
        self._status: Any = None
        self._started = time.monotonic()
        self._next_log = self._started + first_s

    def __enter__(self) -> Waiting:
        return self

    def update(self, what: str, **fields: Any) -> None:
        now = time.monotonic()
        waited = now - self._started
        if self.enabled:
            if self._status is None:
                from rich.console import Console

                self._status = Console(file=sys.stderr).status(what)
                self._status.start()
            details = ", ".join(f"{k} {v}" for k, v in fields.items())
            self._status.update(
                f"{what} ({details}, {waited:.0f} s)" if details else f"{what} ({waited:.0f} s)"
            )
        elif now >= self._next_log:
            self._next_log = now + self.every_s
            self.log.info(what, waited_s=round(waited), **fields)

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
