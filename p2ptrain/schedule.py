"""A volunteer's machine comes first: when a peer pauses, and what it measures to decide.

The decision is a pure function of one reading (:func:`pause_reason`), and :class:`Schedule` adds the
hysteresis: it pauses as soon as a reason shows, and resumes only once none has shown for
``schedule.resume_after_s``, so that a peer does not flap in and out of rounds; a peer that pauses again
soon after resuming waits twice as long the next time (:func:`resume_wait_s`). What is read comes from a
:class:`Machine` (psutil, so Linux, macOS and Windows alike): the CPU that *other* processes use (the
machine's minus this peer's own process tree: the trainer, hivemind's children and ``p2pd``), the battery
and the local time. Tests pass a machine of their own.

A paused peer stays in the swarm as ``paused`` (its record says so): nobody waits for it at a barrier or
counts it in a round's roster, and when it resumes it catches up as any peer that fell behind does. It
keeps its children and ``p2pd`` running: on a GPU they cannot be forked again once CUDA is in use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from datetime import time as clock_time
from typing import Protocol

from p2ptrain.config import ScheduleConfig, parse_hours


@dataclass(frozen=True)
class Reading:
    """What the machine looks like now."""

    other_cpu: float | None
    """The share (0 to 1) of the CPU time this peer left free that other processes used since the last
    reading: near 1 when they fill the machine, whatever this peer's own share."""
    on_battery: bool | None
    """None: no battery (or it cannot tell)."""
    now: datetime = field(default_factory=datetime.now)
    """Local time."""


class Probe(Protocol):
    def read(self) -> Reading: ...


def within(hours: str, at: clock_time) -> bool:
    """Whether ``at`` falls in the window (which may wrap midnight: '22:00-07:00')."""
    start, end = parse_hours(hours)
    if start <= end:
        return start <= at < end
    return at >= start or at < end


def pause_reason(cfg: ScheduleConfig, reading: Reading) -> str | None:
    """Why the peer should not train now, or None."""
    if cfg.hours is not None and not within(cfg.hours, reading.now.time()):
        return f"outside schedule.hours {cfg.hours}"
    if cfg.pause_on_battery and reading.on_battery:
        return "on battery (schedule.pause_on_battery)"
    if (
        cfg.max_other_cpu is not None
        and reading.other_cpu is not None
        and reading.other_cpu > cfg.max_other_cpu
    ):
        return (
            f"other processes use {reading.other_cpu:.0%} of the CPU (schedule.max_other_cpu "
            f"{cfg.max_other_cpu:.0%})"
        )
    return None


MAX_BACKOFF = 16
"""The longest wait before resuming, in ``schedule.resume_after_s``: what repeated flaps back off to."""


def resume_wait_s(base_s: float, last_wait_s: float | None, trained_s: float | None) -> float:
    """How long the machine must stay free before a peer that pauses now resumes.

    A peer can flap: its own training is part of what it reads (a program busy on one core of two reads
    1.0 of what a training peer leaves free, 0.5 of what a paused one does), so under a steady load it may
    pause, resume once the machine looks free without it, and pause again at once, each time dropping a
    round's work and loading the swarm's state. A pause that comes before the peer trained as long as it
    last waited to resume is such a flap: the next wait doubles, up to :data:`MAX_BACKOFF` times
    ``base_s``; a pause after a longer stretch of training waits ``base_s`` again.

    Args:
        base_s: ``schedule.resume_after_s``.
        last_wait_s: the wait before the last resume (None: the peer never paused).
        trained_s: how long it trained between that resume and this pause, from its first check after the
            resume (None: it never resumed).
    """
    if last_wait_s is None or trained_s is None or trained_s >= last_wait_s:
        return base_s
    return min(2 * max(last_wait_s, base_s), MAX_BACKOFF * base_s)


class Schedule:
    """Asks the machine at most every ``schedule.check_every_s`` whether the peer may train.

    Args:
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, cfg: ScheduleConfig, machine: Probe, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.machine, self.clock = cfg, machine, clock
        self._checked = -float("inf")
        self._paused_for: str | None = None
        self._clear_since: float | None = None
        self.wait_s: float = cfg.resume_after_s
        """How long the machine must stay free before the peer resumes from this (or its last) pause."""
        self._waited_s: float | None = None
        self._resumed_at: float | None = None
        self._resuming = False
        """Resumed, and not asked since: the next check comes when the peer trains again (after it caught up
        with the swarm, which can take longer than it waited), and the time it trained counts from there."""

    def check(self) -> str | None:
        """None: train. Otherwise why the peer is paused (or stays paused until the machine has been free
        for :attr:`wait_s`: ``schedule.resume_after_s``, more after flaps, :func:`resume_wait_s`). Cheap between
        readings: call it every step."""
        now = self.clock()
        if self._resuming:
            self._resumed_at, self._resuming = now, False
        if now - self._checked < self.cfg.check_every_s:
            return self._paused_for
        self._checked = now
        reason = pause_reason(self.cfg, self.machine.read())
        if reason is not None:
            if self._paused_for is None:  # a new pause
                trained_s = None if self._resumed_at is None else now - self._resumed_at
                self.wait_s = resume_wait_s(self.cfg.resume_after_s, self._waited_s, trained_s)
            self._paused_for, self._clear_since = reason, None
        elif self._paused_for is not None:
            if self._clear_since is None:
                self._clear_since = now
            if now - self._clear_since >= self.wait_s:
                self._paused_for, self._clear_since = None, None
                self._waited_s, self._resuming = self.wait_s, True
        return self._paused_for


class Machine:
    """This machine as psutil reports it. Other processes' CPU is the machine's busy time minus this peer's
    own process tree's, over the time this peer left free, both since the last reading."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._last_total = self._busy_and_total()
        self._last_own = self._own_cpu_s()

    def _busy_and_total(self) -> tuple[float, float]:
        t = self._psutil.cpu_times()
        # Linux counts guest time in user and nice too (psutil's own total subtracts it, as here).
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        idle = t.idle + getattr(t, "iowait", 0.0)
        return total - idle, total

    def _own_cpu_s(self) -> dict[int, float]:
        own = {}
        for p in [self._me, *self._me.children(recursive=True)]:
            try:
                c = p.cpu_times()
                own[p.pid] = c.user + c.system
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
        return own

    def read(self) -> Reading:
        (busy0, total0), self._last_total = self._last_total, self._busy_and_total()
        busy1, total1 = self._last_total
        own0, self._last_own = self._last_own, self._own_cpu_s()
        own = sum(max(0.0, t - own0.get(pid, 0.0)) for pid, t in self._last_own.items())
        # The share of what we leave free that others use: on a machine they fill, that nears 1 whatever our own
        # share (as a share of the whole machine, it could never pass 1 - ours, and a threshold above that
        # would never pause us).
        free = (total1 - total0) - own
        other = max(0.0, (busy1 - busy0) - own) / free if free > 0 else None
        battery = self._psutil.sensors_battery()
        return Reading(
            other_cpu=min(other, 1.0) if other is not None else None,
            on_battery=None if battery is None else not battery.power_plugged,
        )


def own_memory_bytes() -> int:
    """The memory this peer's processes hold (trainer, hivemind's children, ``p2pd``): their proportional set
    size where the system reports it (shared pages counted once), else their resident set size."""
    import psutil

    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            info = p.memory_full_info() if hasattr(p, "memory_full_info") else p.memory_info()
            total += getattr(info, "pss", info.rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def memory_problem(cap_gb: float | None, used_bytes: int, when: str) -> str | None:
    """Why this peer is over its memory cap (``device.max_memory_gb``), or None."""
    if cap_gb is None or used_bytes <= cap_gb * 2**30:
        return None
    return (
        f"device.max_memory_gb {cap_gb:g}: this peer's processes hold {used_bytes / 2**30:.2f} GB {when}; raise "
        "the cap, or train a smaller model (model.name) or batch (inner.batch_size)"
    )
