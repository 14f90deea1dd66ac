"""A donor's places for state downloads (averaging.to_preempt): who gives way when all are taken."""

from __future__ import annotations

from p2ptrain.averaging import IDLE_DOWNLOAD_S, MIN_SERVING_RATE, RATE_JUDGED_S, _Serving, to_preempt

NOW = 1000.0


def serving(first_piece_at: float | None, sent: int = 0, waiting_since: float | None = None) -> _Serving:
    return _Serving(task=None, first_piece_at=first_piece_at, sent=sent, waiting_since=waiting_since)


def test_the_download_whose_piece_waited_longest_gives_way_once_it_waited_long_enough():
    busy = {
        "a": serving(NOW - 5, 10**6, waiting_since=NOW - 0.1),
        "b": serving(NOW - 5, 10**6, waiting_since=NOW - IDLE_DOWNLOAD_S / 2),
        "making": serving(None),  # its donor still makes the state ready: nothing waits for its reader
        "next": serving(NOW - 5, 10**6),  # its donor makes the next piece
    }
    assert to_preempt(busy, NOW) is None, "every reader took a piece lately, and none has run long enough"
    assert to_preempt({**busy, "c": serving(NOW - 5, 0, waiting_since=NOW - IDLE_DOWNLOAD_S)}, NOW) == "c"
    stale = {**busy, "c": serving(NOW - 50, 0, NOW - 20), "d": serving(NOW - 50, 0, NOW - 30)}
    assert to_preempt(stale, NOW) == "d"


def test_a_reader_under_the_rate_gives_way_once_judged_and_a_fast_one_never():
    age = RATE_JUDGED_S + 1
    slow = serving(NOW - age, int(0.5 * MIN_SERVING_RATE * age))  # a piece now and then
    slower = serving(NOW - age, int(0.2 * MIN_SERVING_RATE * age))
    fast = serving(NOW - age, int(100 * MIN_SERVING_RATE * age))
    young = serving(NOW - RATE_JUDGED_S / 2, 0)  # buffers still filling: not judged yet
    assert to_preempt({"slow": slow, "slower": slower, "fast": fast, "young": young}, NOW) == "slower"
    assert to_preempt({"fast": fast, "young": young, "making": serving(None)}, NOW) is None
    assert to_preempt({}, NOW) is None
