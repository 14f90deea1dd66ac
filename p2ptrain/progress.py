"""A progress bar for the inner steps of a round, on a terminal only (never in logs, pipes or services)."""

from __future__ import annotations

import sys
import time
from typing import Any


class InnerProgress:
    """``with InnerProgress(enabled, total=H, round=r) as bar: ... bar.update(loss_fn, samples)``.

    Disabled, it does nothing at all. Enabled, it redraws at most every ``refresh_s`` and only then asks
    for the loss (a device sync), so it costs nothing per step.
    """

    def __init__(self, enabled: bool, *, total: int, round: int, refresh_s: float = 0.5):
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
        if now - self._last < self.refresh_s and steps < self.total:
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
