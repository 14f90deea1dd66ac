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


def test_a_round_by_time_has_a_bar_without_a_total(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    asked = []
    with InnerProgress(True, total=None, round=3, refresh_s=3600) as bar:
        for step in range(1, 101):
            bar.update(step, step * 8, lambda: asked.append(1) or 2.0)
    assert len(asked) == 1, "the first step only: no last step to redraw at"


def test_a_wait_is_logged_once_it_lasts_then_at_most_every_period():
    from p2ptrain.progress import Waiting

    lines = []

    class Log:
        def info(self, event, **fields):
            lines.append((event, fields))

    with Waiting(False, Log(), first_s=0.0, every_s=3600) as waiting:
        waiting.update("round 3: waiting for peers to finish it", ready=1, waiting_for=2)
        waiting.update("round 3: waiting for peers to finish it", ready=2, waiting_for=1)
    assert [event for event, _ in lines] == ["round 3: waiting for peers to finish it"]
    assert lines[0][1]["waiting_for"] == 2 and "waited_s" in lines[0][1]
    with Waiting(False, Log(), first_s=3600, every_s=3600) as waiting:
        waiting.update("a short wait")
    assert len(lines) == 1, "a wait shorter than first_s says nothing"


def test_a_wait_on_a_terminal_shows_a_spinner_and_logs_nothing(monkeypatch):
    from p2ptrain.progress import Waiting

    monkeypatch.setattr("sys.stderr", io.StringIO())
    logged = []
    with Waiting(True, type("L", (), {"info": lambda *a, **k: logged.append(a)})(), first_s=0) as waiting:
        waiting.update("round 1: averaging", peers=3)
    assert logged == []
