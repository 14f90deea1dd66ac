"""DiLoCo's outer loop, apart from the network (Douillard et al., 2023).

Every peer holds the global params of the current round as a CPU float32 master copy and trains a
device copy for H inner steps. Then:

    delta_i   = master - local_i                 (the pseudo-gradient, old minus new)
    delta     = sum_i w_i delta_i / sum_i w_i    (through an :class:`Averager`, w_i = samples)
    master    = SGD-Nesterov(master, grad=delta) (lr 0.7, momentum 0.9 by default)
    local     = master

The network sits behind :class:`Averager`; unit tests use a fake one.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn

if TYPE_CHECKING:  # the algorithm stays free of hivemind; the codec comes in from outside
    from p2ptrain.compression import ErrorFeedback


class AveragingFailed(RuntimeError):
    """An all-reduce did not produce an average. ``reason`` is a short metric-friendly label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class AverageResult:
    tensors: list[torch.Tensor]
    """The weighted average of the group's tensors (CPU float32), identical on every member."""
    group_size: int
    bytes_sent: int = 0
    bytes_received: int = 0
    peers: list[str] = field(default_factory=list)
    outliers: dict[str, int] = field(default_factory=dict)
    """Groupmates whose parts of the pseudo-gradient this peer's reducer left out of the aggregate (robust
    aggregation), and how many parts: each reducer sees only its own slice."""
    refused: list[str] = field(default_factory=list)
    """Every peer this peer's averager has left out for good so far for what it saw it do (it misbehaved
    towards our reducer); bans, which the trainer holds, are not included."""
    stalled: list[str] = field(default_factory=list)
    """Peers this peer's averager leaves out of the next rounds: they stalled an all-reduce."""
    matchmaking_s: float = 0.0
    """Of the successful attempt: from asking for a group until it was formed (on the averager's pipe)."""
    allreduce_s: float = 0.0
    """Of the successful attempt: from the group's forming to the average."""


class Averager(Protocol):
    def average(
        self, tensors: Sequence[torch.Tensor], *, weight: float, round: int, attempts: int | None = None
    ) -> AverageResult:
        """Average ``tensors`` with the peers of ``round``, weighted by ``weight``, in ``attempts`` attempts at
        most (None: as configured).

        Raises:
            AveragingFailed: no group, a timeout, or a groupmate that left mid-way. The caller still
                holds its own tensors; nothing was applied.
        """
        ...


@dataclass
class OuterStepReport:
    round: int
    """The round that just ended (the params are now those of round + 1)."""
    group_size: int
    """Peers whose pseudo-gradients went into the step (1: this peer's alone)."""
    delta_norm: float
    """Norm of this peer's own pseudo-gradient."""
    applied: bool
    """False when nothing was applied (a non-finite pseudo-gradient)."""
    failure: str | None = None
    """Why the peer fell back to its own pseudo-gradient or skipped the step, if it did."""
    bytes_sent: int = 0
    bytes_received: int = 0
    peers: list[str] = field(default_factory=list)
    """The group's peer ids, when it averaged with one."""
    outliers: dict[str, int] = field(default_factory=dict)
    """Groupmates whose parts our reducer left out of the aggregate (``AverageResult.outliers``)."""
    refused: list[str] = field(default_factory=list)
    """``AverageResult.refused``."""
    stalled: list[str] = field(default_factory=list)
    """``AverageResult.stalled``."""
    matchmaking_s: float = 0.0
    """``AverageResult.matchmaking_s`` (0 without an average)."""
    allreduce_s: float = 0.0
    """``AverageResult.allreduce_s`` (0 without an average)."""


@dataclass
class _Detached:
    delta: list[torch.Tensor]
    """The round's pseudo-gradient, frozen: what its sync sends."""
    start: list[torch.Tensor]
    """The local params the model went on training from (CPU, float32)."""
    keep: bool = True
    """Whether the inner progress made since is carried over onto the master params when the sync lands."""


@dataclass
class Snapshot:
    round: int
    params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    residuals: list[torch.Tensor]
    """Error-feedback residuals (empty without error feedback)."""


class DiLoCo:
    """The outer optimizer of one peer: master params, outer momentum, pseudo-gradients.

    Thread safety: :meth:`snapshot` may be called from hivemind's state-sharing thread while the
    trainer runs :meth:`outer_step`; both hold ``self.lock``, so a newcomer never downloads a
    half-updated state.

    Overlap (``outer.overlap``): :meth:`detach` freezes the round's pseudo-gradient, and the round's sync
    (another thread) works on that and on the master copy only, while the model trains the next round.
    Meanwhile every call that would overwrite the model only says what should become of it: carry the
    inner progress made since over onto the new master params (after an outer step, a void round), or drop
    it (a failed round that may not step alone). :meth:`land`, between two inner steps, does it. (The
    trainer's barrier, and with it a rebase or a stale round, comes before :meth:`detach`; :meth:`rebase`
    and :meth:`reset_model` still honour a detached round.)
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        momentum: float,
        nesterov: bool,
        error_feedback: ErrorFeedback | None = None,
        carry: float = 1.0,
    ):
        self.carry = carry
        """Overlap: the share of the inner progress made since :meth:`detach` that :meth:`land` keeps."""
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        # The master copy: CPU float32, whatever the device and dtype of the inner phase.
        self.master = [p.detach().to("cpu", torch.float32, copy=True) for p in self.model_params]
        self.optimizer = torch.optim.SGD(
            self.master, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0
        )
        self.lock = threading.Lock()
        self.error_feedback = error_feedback
        self.round = 0
        """The round whose global params ``master`` holds; advanced by :meth:`outer_step`, under the lock."""
        self._version = 0  # bumped whenever master changes; keys the cached params hash
        self._hash: tuple[int, str] | None = None
        self._detached: _Detached | None = None
        # After a rebase: the pseudo-gradient kept, and the versions of the tensors it stands for (_versions).
        self._rebased: tuple[list[torch.Tensor], list[int]] | None = None

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """delta = master - local, in float32 on CPU (while detached: the frozen one; after a rebase, the one
        kept, bit for bit, until the master or the model changes)."""
        detached = self._detached
        if detached is not None:
            return [d.clone() for d in detached.delta]
        if self._rebased is not None:
            delta, versions = self._rebased
            if versions == self._versions():
                return [d.clone() for d in delta]
            self._rebased = None
        with torch.no_grad():
            return [m - p.detach().to("cpu", torch.float32) for m, p in zip(self.master, self.model_params)]

    def _versions(self) -> list[int]:
        """torch's version counters of the master and model params: any in-place change bumps them (an inner
        step, an outer step, a load)."""
        return [t._version for t in (*self.master, *self.model_params)]

    @property
    def detached(self) -> bool:
        """A sync of a frozen pseudo-gradient is in flight while the model trains on (:meth:`detach`)."""
        return self._detached is not None

    def detach(self) -> None:
        """Freeze this round's pseudo-gradient, and the local params the model trains on from: the round's
        sync may now run in another thread while the model trains the next round (until :meth:`land`)."""
        with torch.no_grad(), self.lock:
            local = [p.detach().to("cpu", torch.float32, copy=True) for p in self.model_params]
            self._detached = _Detached(delta=[m - loc for m, loc in zip(self.master, local)], start=local)

    def land(self) -> bool:
        """End a detached sync (in the thread that trains the model, between two steps): carry the inner
        progress made since :meth:`detach` over onto the master params (local = master + carry * (local -
        start)), or drop it (local = master) if the sync said so. Returns whether the progress was kept.

        Those steps were taken from our own params, not from the new master ones, and they are worth less
        there the further apart the two are: ``carry`` < 1 keeps a share of them (``outer.overlap_carry``)."""
        with torch.no_grad(), self.lock:
            detached, self._detached = self._detached, None
            if detached is None:
                return True
            if not detached.keep:
                self._copy_master_to_model()
                return False
            for p, m, start in zip(self.model_params, self.master, detached.start):
                if self.carry == 1.0:  # all of it: as before the share existed, bit for bit
                    p.add_((m - start).to(p.device, p.dtype))
                else:
                    progress = p.detach().to("cpu", torch.float32) - start
                    p.copy_((m + self.carry * progress).to(p.device, p.dtype))
            return True

    def outer_step(self, averaged_delta: Sequence[torch.Tensor]) -> None:
        """Apply one outer SGD step with ``averaged_delta`` as the gradient; copy the result to the model."""
        self._rebased = None  # not held past the round it was kept for (a whole model's float32 copy)
        with self.lock:
            for m, d in zip(self.master, averaged_delta):
                m.grad = d.to(torch.float32)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.round += 1
            self._version += 1
        self._next_round_from_master()

    def void_round(self) -> None:
        """End the round without a step: nobody's pseudo-gradient counts (the params stay, the round passes)."""
        self._rebased = None
        with self.lock:
            self.round += 1
            self._version += 1
        self._next_round_from_master()

    def _next_round_from_master(self) -> None:
        """The model starts the next round from the master params (detached: keeps what it trained since)."""
        if self._mark_detached(keep=True):
            return
        self.reset_model()

    def reset_model(self) -> None:
        """Overwrite the device params with the master params (start of a round, or undoing one). Detached:
        the inner progress made since :meth:`detach` is to be dropped when the sync lands."""
        self._rebased = None
        if self._mark_detached(keep=False):
            return
        with torch.no_grad():
            self._copy_master_to_model()

    def _copy_master_to_model(self) -> None:
        for p, m in zip(self.model_params, self.master):
            p.copy_(m.to(p.device, p.dtype))

    def _mark_detached(self, *, keep: bool) -> bool:
        with self.lock:
            if self._detached is None:
                return False
            self._detached.keep = keep
            return True

    def rebase(self, delta: Sequence[torch.Tensor]) -> None:
        """Put our inner progress on top of (new) master params: local = master - delta.

        Used when a peer finds, after its inner phase, that its global params differ from the swarm's: it
        adopts the swarm's params and keeps its pseudo-gradient, instead of throwing the round's work away.
        Detached, the frozen pseudo-gradient is the one kept, and the model gets it when the sync lands.
        """
        if self._mark_detached(keep=True):
            return
        with torch.no_grad():
            for p, m, d in zip(self.model_params, self.master, delta):
                p.copy_((m - d).to(p.device, p.dtype))
        # master - (master - delta) is delta only up to rounding: a verifiable round's parts, sealed before
        # the rebase, would differ from those sent after it, and its reducers would refuse us for good.
        self._rebased = ([d.detach().to("cpu", torch.float32, copy=True) for d in delta], self._versions())

    def sync(
        self,
        averager: Averager | None,
        *,
        weight: float,
        round: int,
        fallback: Callable[[], bool] = lambda: True,
        again: Callable[[], bool] = lambda: False,
    ) -> OuterStepReport:
        """End a round: average the pseudo-gradient (if there is anyone to average with) and step.

        Failure semantics: a pseudo-gradient with NaN or Inf is never sent; the peer keeps its global
        params and skips the step. An average that is malformed or not finite is refused (reason
        ``rejected``), and not tried again. If the averager fails (no group, timeout, a peer left mid-way),
        the peer tries once more each time ``again()`` says so (the trainer: a groupmate is still averaging
        this round); then it applies its own pseudo-gradient if ``fallback()`` says so (the trainer says no
        when the swarm has moved past this round: it will load the swarm's state instead), and says so in the
        report.
        """
        delta = self.pseudo_gradient()
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in delta])))
        if not all(torch.isfinite(d).all() for d in delta):
            self.reset_model()
            return OuterStepReport(round, group_size=0, delta_norm=norm, applied=False, failure="non_finite")
        if averager is None:
            self.outer_step(delta)
            return OuterStepReport(round, group_size=1, delta_norm=norm, applied=True, failure=None)
        ef = self.error_feedback
        # With error feedback we send Q(delta + residual): already on the wire's grid, so what the codec drops
        # is exactly the residual we keep.
        sent = ef.prepare(delta) if ef else delta
        try:
            attempts = None  # as configured, then one at a time, each once again() says so
            while True:
                try:
                    result = averager.average(sent, weight=weight, round=round, attempts=attempts)
                    break
                except AveragingFailed as e:
                    if e.reason == "stopped" or not again():
                        raise
                attempts = 1
            problem = self.check_average(result.tensors)
            if problem is not None:  # what groupmates sent is never trusted: refuse it, as a failed average
                raise AveragingFailed("rejected", problem)
        except AveragingFailed as e:
            if ef:
                ef.discard()  # nothing was sent: the old residual still stands
            if e.reason == "stopped" or not fallback():  # keep the round's global params as they are
                self.reset_model()
                return OuterStepReport(round, group_size=0, delta_norm=norm, applied=False, failure=e.reason)
            self.outer_step(delta)
            return OuterStepReport(round, group_size=1, delta_norm=norm, applied=True, failure=e.reason)
        if ef:
            ef.commit()
        self.outer_step(result.tensors)
        return OuterStepReport(
            round,
            group_size=result.group_size,
            delta_norm=norm,
            applied=True,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            peers=list(result.peers),
            outliers=dict(result.outliers),
            refused=list(result.refused),
            stalled=list(result.stalled),
            matchmaking_s=result.matchmaking_s,
            allreduce_s=result.allreduce_s,
        )

    def check_average(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """Why an averaged pseudo-gradient must not be applied (None: it may): the wrong number, shape or
        dtype of tensors, or values that are not finite (one NaN from anyone would make every param NaN)."""
        return misfit("average", tensors, self.master)

    # --- state, for newcomers and checkpoints --------------------------------------------------

    def momentum_buffers(self) -> list[torch.Tensor]:
        buffers = []
        for m in self.master:
            buf = self.optimizer.state.get(m, {}).get("momentum_buffer")
            buffers.append(buf if buf is not None else torch.zeros_like(m))
        return buffers

    def snapshot(self) -> Snapshot:
        """A consistent copy of the outer state, safe to take while another thread runs :meth:`outer_step`."""
        with self.lock:
            return Snapshot(
                round=self.round,
                params=[m.clone() for m in self.master],
                momentum=[b.clone() for b in self.momentum_buffers()],
                residuals=[r.clone() for r in self.error_feedback.residuals] if self.error_feedback else [],
            )

    def state_tensors(self) -> list[torch.Tensor]:
        """Master params, then outer momentum buffers: what :meth:`load_state_tensors` takes."""
        snap = self.snapshot()
        return snap.params + snap.momentum

    def load_state_tensors(self, tensors: Sequence[torch.Tensor], round: int) -> None:
        """Adopt a state from :meth:`state_tensors` (of a donor peer or a checkpoint) as round ``round``.

        Raises:
            ValueError: the tensors do not match this model (count, shapes, dtypes) or are not finite.
        """
        n = len(self.master)
        problem = misfit("state", tensors, self.master + self.master)
        if problem is not None:
            raise ValueError(problem)
        self._rebased = None
        with self.lock:
            for m, t in zip(self.master, tensors[:n]):
                m.copy_(t)
            for m, t in zip(self.master, tensors[n:]):
                self.optimizer.state[m]["momentum_buffer"] = t.clone()
            self.round = round
            self._version += 1
        self.reset_model()

    def params_hash(self) -> str:
        """:func:`tensors_hash` of the round's global state, master params then outer momentum (what
        :meth:`state_tensors` returns and a donor serves), cached until they change. Peers of a round compare
        it (``ProgressRecord.params_hash``): honest ones hold both bit-identical, and a newcomer loads a
        state only if this hash of all it received is the one they report, momentum included."""
        with self.lock:
            if self._hash is None or self._hash[0] != self._version:
                self._hash = (self._version, tensors_hash(self.master + self.momentum_buffers()))
            return self._hash[1]


def misfit(what: str, tensors: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> str | None:
    """Why ``tensors`` (from another peer, or a file) do not fit where ``like`` are: their count, a shape or
    dtype, or a value that is not finite. None if they fit."""
    if len(tensors) != len(like):
        return f"{what} has {len(tensors)} tensors, expected {len(like)}"
    for i, (t, m) in enumerate(zip(tensors, like)):
        if not isinstance(t, torch.Tensor) or t.shape != m.shape or t.dtype != m.dtype:
            found = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"{what} tensor {i}: {found}, expected {tuple(m.shape)} {m.dtype}"
        if not torch.isfinite(t).all():
            return f"{what} tensor {i} has non-finite values"
    return None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, whatever its dtype (numpy has no bfloat16, and a file may hold any)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def tensors_hash(tensors: Sequence[torch.Tensor]) -> str:
    """A short, exact fingerprint of tensors' bytes (equal hashes: bit-identical params)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(tensor_bytes(t))
    return h.hexdigest()[:16]
