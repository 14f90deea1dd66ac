"""The trainer's link to the swarm: a records board and an averager, behind two small interfaces.

:func:`connect_hivemind` builds the real ones: a DHT child (with ``p2pd``) for the records and an averager
child for the all-reduce and state transfer, forked from this process. Tests connect trainers to an
in-memory swarm instead (``tests/memswarm.py``), so that the round protocol runs in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from p2ptrain import telemetry
from p2ptrain.compression import Layout
from p2ptrain.config import ExperimentConfig
from p2ptrain.diloco import AverageResult
from p2ptrain.experiment import Experiment, ExperimentRecord
from p2ptrain.records import ProgressRecord, live
from p2ptrain.verify import Sealed

StateProvider = Callable[[], tuple[dict, list[torch.Tensor]]]
"""What a donor serves: metadata and tensors (``transfer.donation``)."""


class Board(Protocol):
    """The swarm's progress records, as one peer reads and writes them (``swarm.Swarm`` on a DHT)."""

    peer_id: str

    def visible_maddrs(self) -> list[str]: ...

    def start(self) -> None:
        """Start publishing our record (a heartbeat)."""

    def update(self, **changes: Any) -> None:
        """Change fields of our record (``round``, ``state``, ``params_hash``, samples...)."""

    def subscribe(self, observer: Callable[[dict[str, ProgressRecord]], None]) -> None:
        """Call ``observer`` with every reading of the records (the heartbeat's included)."""

    def records(self) -> dict[str, ProgressRecord]:
        """Every unexpired record by peer id, ``left`` ones and our own included."""
        ...

    def wait_for_news(self, timeout_s: float) -> None:
        """Return when the records may have changed since the last :meth:`records` (or after ``timeout_s``)."""

    def experiments(self) -> list[Experiment]:
        """Every experiment published in the swarm whose owner's signature holds."""
        ...

    def sign_experiment(self, cfg: ExperimentConfig) -> ExperimentRecord:
        """``cfg``'s training sections signed by this peer: it starts the run."""
        ...

    def carry_experiment(self, record: ExperimentRecord) -> None:
        """Keep the run's signed experiment in the swarm (republished under this peer's name)."""

    def shutdown(self) -> None: ...


class PeerAverager(Protocol):
    """The all-reduce and state transfer (``averaging.SwarmAverager`` on hivemind)."""

    def average(
        self, tensors: Sequence[torch.Tensor], *, weight: float, round: int, attempts: int | None = None
    ) -> AverageResult:
        """Average ``tensors`` with the peers of ``round``, in ``attempts`` attempts at most (None:
        ``1 + averaging.retries``)."""
        ...

    def download_state(self, donors: Sequence[str], timeout: float) -> tuple[str, Any, list] | None:
        """(donor, metadata, tensors) from the first donor that serves its state, or None."""
        ...

    def expect_group(self, peers: Sequence[str], round: int, clients: Sequence[str] = ()) -> None:
        """The all-reduce of ``round`` is with ``peers``, as the barrier knows them (us included):
        matchmaking ends once they have joined, rather than waiting out ``averaging.matchmaking_time_s``.
        ``clients``: those of ``peers`` in client mode, which take no calls."""

    def leave_out(
        self,
        peers: Sequence[str],
        round: int,
        weights: Mapping[str, float] | None = None,
        sealed: Mapping[str, Sealed] | None = None,
    ) -> None:
        """Refuse to average with ``peers`` in ``round`` (they were not verified); count each other peer
        with its weight in ``weights`` (the verdict's) and refuse it if it claims another, or sends a part
        other than it sealed in ``sealed``."""

    def ban(self, peers: Sequence[str]) -> None:
        """Never average with ``peers`` again, nor serve them our state."""

    def unban(self, peers: Sequence[str]) -> None:
        """Lift :meth:`ban` from ``peers`` (the swarm's reputation does not ban them: ours had drifted). What
        our averager saw them do itself still stands."""

    def left_out_of(self, peers: Sequence[str], round: int) -> list[str]:
        """Those of ``peers`` we do not average with in ``round`` (faults seen, bans, a verdict)."""
        ...

    def shutdown(self) -> None: ...


@dataclass
class Link:
    board: Board
    averager: PeerAverager

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        finally:  # the board (goodbye record, DHT child, p2pd) goes even if the averager's stop failed
            self.board.shutdown()


Connect = Callable[..., Link]
"""Builds a peer's :class:`Link`, called as :func:`connect_hivemind` is (tests pass an in-memory swarm's)."""


def connect_hivemind(
    cfg: ExperimentConfig,
    *,
    device: str,
    layout: Layout,
    state_provider: StateProvider,
    stop: threading.Event,
) -> Link:
    """Join the swarm for real: a DHT child (with p2pd) and an averager child, forked from this process.

    Raises:
        SwarmError: the swarm cannot be reached.
    """
    from p2ptrain.averaging import SwarmAverager
    from p2ptrain.swarm import Swarm

    swarm = Swarm(cfg.run.run_id, cfg.swarm, device=device)
    swarm.subscribe(lambda records: telemetry.observe_swarm(live(records)))
    try:
        averager = SwarmAverager(
            swarm.dht,
            run_id=cfg.run.run_id,
            layout=layout,
            cfg=cfg.averaging,
            client_mode=cfg.swarm.client_mode,
            state_provider=state_provider,
            # The most samples a peer can have processed in one round: a larger claimed weight is a lie.
            max_weight=cfg.inner.num_inner_steps * cfg.inner.batch_size,
            stop=stop,
        )
    except BaseException:
        swarm.shutdown(say_goodbye=False)
        raise
    return Link(swarm, averager)
