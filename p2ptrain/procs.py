"""hivemind's forked children, made to behave: they die with their parent and leave signals to it.

One peer is the main process plus hivemind's DHT child (which owns ``p2pd``) and averager child.
hivemind leaves both children, and ``p2pd``, running forever when the main process is SIGKILLed;
:class:`ParentWatchdog` makes each child shut itself down within seconds when its parent disappears.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator


class ParentWatchdog:
    """Mixin for hivemind's forked children: shut down cleanly when the parent process dies.

    Set ``_watched_parent_pid = os.getpid()`` in ``__init__`` (in the parent, before the fork) and call
    :meth:`_start_parent_watchdog` first thing in the child's ``run()``.
    """

    _watched_parent_pid: int

    def _start_parent_watchdog(
        self, on_orphaned: Callable[[], None], grace_s: float = 10.0, own_process_group: bool = False
    ) -> None:
        """
        Args:
            on_orphaned: starts the child's own clean shutdown; runs in a thread of the child.
            grace_s: if the clean shutdown has not ended the process after this long, exit hard.
            own_process_group: move the child (and what it spawns, like p2pd) out of the terminal's
                foreground process group, so that Ctrl-C reaches only the main process, which then shuts
                the children down in order. Otherwise p2pd dies first and the clean shutdown fails.
        """
        # The main process's signal handlers were inherited by fork; they are not the child's to run.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if own_process_group:
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)

        def orphaned() -> None:
            try:
                on_orphaned()
            finally:
                time.sleep(grace_s)
                os._exit(1)

        on_parent_exit(self._watched_parent_pid, orphaned)


PARENT_PID_ENV = "P2PTRAIN_PARENT_PID"
"""Where a starter of ``p2ptrain join --exit-with-parent`` names itself (``cli.exit_with_parent``)."""


def on_parent_exit(parent: int, callback: Callable[[], None]) -> None:
    """Call ``callback`` in a thread of this process once its parent, ``parent``, is gone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        callback()

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class WholeMessages:
    """A hivemind child's end of its pipe (the DHT's, the averager's), read one whole message at a time.

    hivemind's loop watches the pipe with ``add_reader``, which makes it non-blocking, and reads a message
    once ``poll()`` says one has begun. multiprocessing writes a message over 16 KiB in two writes (its
    header, then its body): read between the two, it raises BlockingIOError with part of the message
    consumed, and every later read is garbage (the child's loop dies on it). A verdict's seals for a few
    peers are that large, and so is a verifiable round's record (its part digests and sketches); reading in
    blocking mode waits for the rest of a message that has begun.
    """

    def __init__(self, connection):
        self._connection = connection

    def recv(self):
        fd = self._connection.fileno()
        os.set_blocking(fd, True)
        try:
            return self._connection.recv()
        finally:
            os.set_blocking(fd, False)

    def __getattr__(self, name: str):
        return getattr(self._connection, name)


class SerialSends:
    """The parent's end of a hivemind child's pipe, sent to by one thread at a time.

    Threads of the main process (the trainer, the heartbeat, the metrics monitor) call the DHT at once, and
    a message over 16 KiB goes in two writes: another thread's message between them corrupts the stream.
    """

    def __init__(self, connection):
        self._connection = connection
        self._lock = threading.Lock()
        # A child forked while another thread held the lock would inherit it held, forever.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()

    def send(self, message) -> None:
        with self._lock:
            self._connection.send(message)

    def __getattr__(self, name: str):
        return getattr(self._connection, name)


@contextlib.contextmanager
def keep_sigint_handler() -> Iterator[None]:
    """hivemind's ``run_in_background`` sets SIGINT to "ignore" in the *calling* process, so that Ctrl-C
    reaches only the main process; this restores our handler afterwards (the children keep ignoring it)."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
