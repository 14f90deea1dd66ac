"""A donor's places for state downloads (averaging.to_preempt): who gives way when all are taken."""

from __future__ import annotations

from p2ptrain.averaging import IDLE_DOWNLOAD_S, MIN_SERVING_RATE, RATE_JUDGED_S, _Serving, to_preempt


def serving(started: float, piece_at: float, sent: int) -> _Serving:
    return _Serving(task=None, started=started, piece_at=piece_at, sent=sent)


def test_the_download_idle_longest_gives_way_once_it_has_been_idle_long_enough():
    now = 1000.0
    busy = {
        "a": serving(now - 5, now - 0.1, 10**6),
        "b": serving(now - 5, now - IDLE_DOWNLOAD_S / 2, 10**6),
    }
    assert to_preempt(busy, now) is None, "every reader took a piece lately, and none has run long enough"
    assert to_preempt({**busy, "c": serving(now - 5, now - IDLE_DOWNLOAD_S, 0)}, now) == "c"
    stale = {**busy, "c": serving(now - 50, now - 20, 0), "d": serving(now - 50, now - 30, 0)}
    assert to_preempt(stale, now) == "d"


def test_a_reader_under_the_rate_gives_way_once_judged_and_a_fast_one_never():
    now = 1000.0
    age = RATE_JUDGED_S + 1
    slow = serving(now - age, now - 1, int(0.5 * MIN_SERVING_RATE * age))  # a piece now and then
    slower = serving(now - age, now - 1, int(0.2 * MIN_SERVING_RATE * age))
    fast = serving(now - age, now - 0.1, int(100 * MIN_SERVING_RATE * age))
    young = serving(now - RATE_JUDGED_S / 2, now - 0.1, 0)  # buffers still filling: not judged yet
    assert to_preempt({"slow": slow, "slower": slower, "fast": fast, "young": young}, now) == "slower"
    assert to_preempt({"fast": fast, "young": young}, now) is None
    assert to_preempt({}, now) is None
