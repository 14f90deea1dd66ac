"""The inner-step progress bar: on a terminal only, and harmless when on."""

import io

from p2ptrain.progress import InnerProgress, terminal_progress_enabled


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not terminal_progress_enabled("auto")
    asked = []
    with InnerProgress(False, total=5, round=0) as bar:
        bar.update(1, 8, lambda: asked.append(1) or 1.0)
    assert asked == [], "a disabled bar never asks for the loss (a device sync)"


def test_bar_asks_for_the_loss_only_when_it_redraws(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    asked = []
    with InnerProgress(True, total=1000, round=3, refresh_s=3600) as bar:
        for step in range(1, 1001):
            bar.update(step, step * 8, lambda: asked.append(1) or 2.0)
    assert len(asked) == 2  # the first step, then the last
    assert not terminal_progress_enabled("json")
